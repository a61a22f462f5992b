SELECT current_schema()::text

SELECT current_user::text,
       current_schema()::text,
       coalesce(has_schema_privilege(current_schema(), 'CREATE'), false),
       (SELECT tableowner::text FROM pg_tables
        WHERE schemaname = current_schema() AND tablename = 'tokenlease_migrations')

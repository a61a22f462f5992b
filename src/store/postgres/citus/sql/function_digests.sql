SELECT coalesce(string_agg(p.proname || ':' ||
                           encode(sha256(convert_to(p.prosrc, 'UTF8')), 'hex'),
                           ',' ORDER BY p.proname), '')
FROM pg_catalog.pg_proc AS p
JOIN pg_catalog.pg_namespace AS n ON n.oid = p.pronamespace
WHERE n.nspname = {schema} AND p.proname = ANY (ARRAY[{names}]::text[])

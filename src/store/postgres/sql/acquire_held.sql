-- tokenlease: refill and take with strict leases (src/store/postgres/lean.rs)
SELECT h.key, h.tokens, h.frac, h.granted, h.updated_us, h.now_us
FROM (SELECT set_config('synchronous_commit',
                        CASE current_setting('synchronous_commit') WHEN 'off' THEN 'on'
                             ELSE current_setting('synchronous_commit') END,
                        true) AS setting) AS durable
CROSS JOIN LATERAL tokenlease_acquire_held(
    CASE WHEN durable.setting IS NOT NULL THEN $1::text[] END, $2::bigint[], $3::bigint[],
    $4::bigint[], $5::bigint[], $6::bigint[], $7::bigint[], $8::bigint[], $9::bigint[],
    $10::bigint[]) AS h

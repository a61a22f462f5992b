-- tokenlease: refill and take, several limits, on one Citus node (src/store/postgres/limits.rs)
SELECT * FROM tokenlease_citus_take_limits($1::text, $2::text[], $3::bigint[], $4::bigint[],
    $5::bigint[], $6::bigint[], $7::bigint[], $8::bigint[], $9::bigint[], $10::integer[],
    $11::integer[])

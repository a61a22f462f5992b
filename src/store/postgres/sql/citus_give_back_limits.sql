-- tokenlease: returns, several limits, on one Citus node (src/store/postgres/limits.rs)
SELECT * FROM tokenlease_citus_give_back_limits($1::text, $2::bigint[], $3::text[],
    $4::bigint[], $5::bigint[], $6::bigint[], $7::bigint[], $8::bigint[], $9::integer[],
    $10::integer[])

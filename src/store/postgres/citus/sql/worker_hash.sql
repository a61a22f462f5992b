SELECT k, worker_hash(k) FROM unnest($1::text[]) AS k

-- Returns of unused lease tokens, one row per return, so that a return retried after a timeout
-- (the first attempt may have committed without the client hearing it) credits the bucket once.
--
-- The id is chosen by the returning process (random 63 bits). The give-back statement inserts
-- the id with ON CONFLICT DO NOTHING and credits the bucket only for ids it inserted, in the
-- same statement. Rows are kept for a day (the idle cleanup removes older ones): far longer than
-- any retry, far shorter than it takes to run out of ids.
CREATE TABLE IF NOT EXISTS tokenlease_returns (
    id          bigint         PRIMARY KEY,
    key         text           NOT NULL,
    amount      numeric(38, 18) NOT NULL,
    returned_at timestamptz    NOT NULL DEFAULT now(),
    CONSTRAINT tokenlease_returns_amount_range
        CHECK (amount <> 'NaN' AND amount > 0 AND amount <= 18446744073709551615)
);

CREATE INDEX IF NOT EXISTS tokenlease_returns_returned_at ON tokenlease_returns (returned_at);

COMMENT ON TABLE tokenlease_returns IS
    'tokenlease lease returns already credited, by id: a retried return credits once';

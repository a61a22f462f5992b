#!/usr/bin/env node
// The peer for scripts/peer-compare.sh: rate-limiter-flexible's RateLimiterPostgres (Node) on the
// same PostgreSQL as tokenlease, as a closed loop of N requests in flight on random keys.
//
//   node peers/rlf-postgres.js --url postgres://… [--keys 10000] [--concurrency 16]
//        [--pool 16] [--duration 10 | --requests N] [--points 100] [--window-s 2]
//
// The limiter creates its own table (`tableCreated: false`) through a pg Pool of `--pool`
// connections; the table is emptied first so every key starts fresh. Each of `--concurrency`
// workers sends its next `consume(key)` as soon as the previous one answered, on a uniformly
// random key out of `--keys`. Nothing is sent after `--duration` seconds (or after `--requests`
// in all). RateLimiterPostgres is a fixed-window counter: `--points` per `--window-s` seconds per
// key (100 per 2 s by default, the same average as tokenlease loadtest's bucket of 100 refilling
// at 50/s), one upsert statement per call.
//
// Prints one JSON line on stdout:
//   {"peer", "requests", "per_sec", "p50_us", "p99_us", "p999_us", "max_us", "allowed",
//    "denied", "errors", "duration_s", "keys", "concurrency", "pool", "statements_per_1k"}
// and a progress line on stderr every second.
'use strict';

const { Pool } = require('pg');
const { RateLimiterPostgres, RateLimiterRes } = require('rate-limiter-flexible');

function parseArgs(argv) {
  const opts = {
    url: process.env.DATABASE_URL,
    keys: 10000,
    concurrency: 16,
    pool: 16,
    duration: undefined,
    requests: undefined,
    points: 100,
    windowS: 2,
  };
  const names = {
    '--url': 'url',
    '--keys': 'keys',
    '--concurrency': 'concurrency',
    '--pool': 'pool',
    '--duration': 'duration',
    '--requests': 'requests',
    '--points': 'points',
    '--window-s': 'windowS',
  };
  for (let i = 0; i < argv.length; i += 2) {
    const name = names[argv[i]];
    if (!name || i + 1 >= argv.length) {
      throw new Error(`unknown option or missing value: ${argv[i]} (options: ${Object.keys(names).join(' ')})`);
    }
    if (name === 'url') {
      opts.url = argv[i + 1];
    } else {
      const v = Number(argv[i + 1]);
      if (!Number.isFinite(v) || v <= 0) {
        throw new Error(`${argv[i]} must be a positive number, got ${argv[i + 1]}`);
      }
      opts[name] = v;
    }
  }
  if (!opts.url) {
    throw new Error('no database: pass --url or set DATABASE_URL');
  }
  if (opts.duration === undefined && opts.requests === undefined) {
    opts.duration = 10;
  }
  return opts;
}

// Nearest-rank percentile of a sorted array.
function percentile(sorted, q) {
  if (sorted.length === 0) {
    return 0;
  }
  return sorted[Math.min(sorted.length - 1, Math.max(0, Math.ceil(q * sorted.length) - 1))];
}

async function main() {
  const opts = parseArgs(process.argv.slice(2));
  const pool = new Pool({ connectionString: opts.url, max: opts.pool });
  const tableName = 'rlf_peer';
  const limiter = await new Promise((resolve, reject) => {
    const l = new RateLimiterPostgres(
      {
        storeClient: pool,
        storeType: 'pool',
        tableName,
        tableCreated: false,
        keyPrefix: 'rlf',
        points: opts.points,
        duration: opts.windowS,
      },
      (err) => (err ? reject(err) : resolve(l)),
    );
  });
  await pool.query(`TRUNCATE "${tableName}"`);
  // Open the pool's connections before the clock starts, as tokenlease's pools are.
  await Promise.all(Array.from({ length: opts.pool }, () => pool.query('SELECT 1')));

  const latenciesUs = [];
  let allowed = 0;
  let denied = 0;
  let errors = 0;
  let firstError;
  let budget = opts.requests === undefined ? Infinity : opts.requests;
  const start = process.hrtime.bigint();
  const end = opts.duration === undefined ? undefined : start + BigInt(Math.round(opts.duration * 1e9));
  const elapsedS = () => Number(process.hrtime.bigint() - start) / 1e9;
  const progress = setInterval(() => {
    const t = elapsedS();
    process.stderr.write(
      `rlf-postgres: ${t.toFixed(1)} s, ${latenciesUs.length} sent (${(latenciesUs.length / t).toFixed(0)}/s), ` +
        `${allowed} allowed, ${errors} errors\n`,
    );
  }, 1000);

  async function worker() {
    while (budget > 0 && (end === undefined || process.hrtime.bigint() < end)) {
      budget -= 1;
      const key = `k${Math.floor(Math.random() * opts.keys)}`;
      const began = process.hrtime.bigint();
      try {
        await limiter.consume(key, 1);
        allowed += 1;
      } catch (rej) {
        if (rej instanceof RateLimiterRes) {
          denied += 1;
        } else {
          errors += 1;
          firstError = firstError || rej;
        }
      }
      latenciesUs.push(Number(process.hrtime.bigint() - began) / 1000);
    }
  }
  await Promise.all(Array.from({ length: opts.concurrency }, worker));
  const durationS = elapsedS();
  clearInterval(progress);
  await pool.end();

  if (firstError) {
    process.stderr.write(`rlf-postgres: ${errors} errors, the first: ${firstError.message || firstError}\n`);
  }
  const sorted = Float64Array.from(latenciesUs).sort();
  const round = (x) => Math.round(x * 10) / 10;
  const report = {
    peer: `rate-limiter-flexible ${require('rate-limiter-flexible/package.json').version} RateLimiterPostgres`,
    requests: latenciesUs.length,
    per_sec: round(latenciesUs.length / durationS),
    p50_us: round(percentile(sorted, 0.5)),
    p99_us: round(percentile(sorted, 0.99)),
    p999_us: round(percentile(sorted, 0.999)),
    max_us: round(sorted.length ? sorted[sorted.length - 1] : 0),
    allowed,
    denied,
    errors,
    duration_s: round(durationS * 1000) / 1000,
    keys: opts.keys,
    concurrency: opts.concurrency,
    pool: opts.pool,
    // One upsert per consume(); the table creation and TRUNCATE before the clock are not counted.
    statements_per_1k: 1000,
  };
  process.stdout.write(`${JSON.stringify(report)}\n`);
}

main().catch((err) => {
  process.stderr.write(`rlf-postgres: ${err.message || err}\n`);
  process.exit(1);
});

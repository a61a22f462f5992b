//! The pure bucket's hot path: `take` when allowed and when denied, and the decimal text of
//! `Tokens` that every SQL call binds and reads back.
//!
//! Run with `cargo bench --bench bucket`.

use std::fmt::Write as _;
use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use tokenlease::bucket::{BucketConfig, BucketState, Rate, Timestamp, Tokens};

fn bucket(c: &mut Criterion) {
    let config = BucketConfig::new(Tokens::whole(100), Rate::per_second(50).unwrap()).unwrap();
    let start = Timestamp::from_nanos(1_700_000_000_000_000_000);
    let full = BucketState::full(&config, start);
    let empty = BucketState {
        tokens: Tokens::ZERO,
        last_refill: start,
    };
    let one = Tokens::whole(1);

    let mut group = c.benchmark_group("bucket");
    group.bench_function("take/allowed", |b| {
        b.iter(|| {
            black_box(full)
                .take(black_box(&config), black_box(start), black_box(one))
                .unwrap()
        })
    });
    group.bench_function("take/allowed_after_refill", |b| {
        let later = Timestamp::from_nanos(start.as_nanos() + 7_000_000);
        let half = BucketState {
            tokens: Tokens::whole(50),
            last_refill: start,
        };
        b.iter(|| {
            black_box(half)
                .take(black_box(&config), black_box(later), black_box(one))
                .unwrap()
        })
    });
    group.bench_function("take/denied", |b| {
        b.iter(|| {
            black_box(empty)
                .take(black_box(&config), black_box(start), black_box(one))
                .unwrap()
        })
    });
    group.bench_function("take/insufficient_capacity", |b| {
        let too_big = Tokens::whole(101);
        b.iter(|| black_box(full).take(black_box(&config), black_box(start), black_box(too_big)))
    });

    let amount = Tokens::from_nanos(12_345_678_901_234);
    let text = amount.to_string();
    group.bench_function("tokens/format", |b| {
        let mut buf = String::with_capacity(64);
        b.iter(|| {
            buf.clear();
            write!(buf, "{}", black_box(amount)).unwrap();
            black_box(buf.len())
        })
    });
    group.bench_function("tokens/parse", |b| {
        b.iter(|| black_box(text.as_str()).parse::<Tokens>().unwrap())
    });
    group.bench_function("tokens/parse_refused", |b| {
        b.iter(|| black_box("1.0000000001").parse::<Tokens>().is_err())
    });
    group.finish();
}

criterion_group! {
    name = benches;
    // No plots: plotters is built with a font feature for `tokenlease chart`, and criterion's
    // plots would then look for a font this bench does not register.
    config = Criterion::default().without_plots();
    targets = bucket
}
criterion_main!(benches);

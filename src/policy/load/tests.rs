//! Unit tests of the policy loader: route patterns, header names, error positions, key rules.

use super::super::routes::{is_header_name, parse_pattern};
use super::*;

#[test]
fn pattern_params_and_shape() {
    let p = parse_pattern("/bookings/{bookingId}/items/{*rest}").unwrap();
    assert_eq!(p.params, ["bookingId", "rest"]);
    assert_eq!(p.shape, "/bookings/{}/items/{*}");
    let p = parse_pattern("/literal/{{braces}}").unwrap();
    assert!(p.params.is_empty());
}

#[test]
fn pattern_refusals() {
    for bad in [
        "/a/{",
        "/a/{}",
        "/a/{b",
        "/a/{b/c}",
        "/a/}",
        "/a/{*rest}/b",
        "/a/{x}/{x}",
        "/a b",
        "/a?b=1",
        "/a/{é}",
        "/items/:id",
        "/files/*rest",
    ] {
        assert!(parse_pattern(bad).is_err(), "{bad} accepted");
    }
}

#[test]
fn older_parameter_syntax_is_refused_with_the_new_spelling() {
    let why = parse_pattern("/items/:id/parts").unwrap_err();
    assert!(why.contains(r#"write it as "{id}""#), "{why}");
    let why = parse_pattern("/files/*rest").unwrap_err();
    assert!(why.contains(r#"write it as "{*rest}""#), "{why}");
    // A colon or star inside a segment is literal text in axum 0.8 too.
    assert!(parse_pattern("/items/v1:batch").is_ok());
    let parsed = parse_pattern("/items/{itemId}").unwrap();
    assert_eq!(parsed.shape, "/items/{}");
    assert_eq!(parse_pattern("/a/{x}/b/{*y}").unwrap().params, ["x", "y"]);
}

#[test]
fn header_names() {
    assert!(is_header_name("x-booking-id"));
    assert!(is_header_name("X-Booking-Id"));
    assert!(!is_header_name(""));
    assert!(!is_header_name("x booking"));
    assert!(!is_header_name("x:booking"));
    assert!(!is_header_name("bööking"));
}

#[test]
fn field_paths_quote_unusual_keys() {
    let mut field = String::from("plans");
    push_key(&mut field, "v1.2");
    field.push_str(".capacity");
    assert_eq!(field, r#"plans["v1.2"].capacity"#);
}

#[test]
fn line_column_of_offsets() {
    assert_eq!(line_column(b"ab\ncd", 0), (1, 1));
    assert_eq!(line_column(b"ab\ncd", 4), (2, 2));
}

#[test]
fn longest_prefix_wins() {
    let json = r#"{
        "plans": { "a": { "capacity": 1, "refill_per_second": 1 },
                   "b": { "capacity": 2, "refill_per_second": 1 },
                   "c": { "capacity": 3, "refill_per_second": 1 } },
        "default_plan": "c",
        "keys": [ { "prefix": "x:", "plan": "a" }, { "prefix": "x:y:", "plan": "b" } ]
    }"#;
    let p = Policies::from_json_str(json, None).unwrap();
    assert_eq!(p.plan_for_key("x:y:1").unwrap().name(), "b");
    assert_eq!(p.plan_for_key("x:z").unwrap().name(), "a");
    assert_eq!(p.plan_for_key("other").unwrap().name(), "c");
    assert_eq!(p.summary(), "<policy>: 3 plans, 0 routes, 2 key rules");
}

//! Policy parser on arbitrary bytes: must return Ok or a one-line error, never panic.
//!
//! Invalid UTF-8 is read lossily so every input reaches the JSON parser.

#![no_main]

use libfuzzer_sys::fuzz_target;
use tokenlease::policy::Policies;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    match Policies::from_json_str(&text, None) {
        Ok(policies) => {
            // Every name an accepted policy references resolves.
            for route in policies.routes() {
                if let Some(global) = &route.global {
                    assert!(policies.plan(global).is_some());
                }
                if let Some(entity) = &route.entity {
                    assert!(policies.plan(&entity.plan).is_some());
                }
            }
            for rule in policies.key_rules() {
                assert!(policies.plan_for_key(&rule.prefix).is_some());
            }
            let _ = policies.summary();
        }
        Err(err) => assert!(!err.to_string().contains('\n')),
    }
});

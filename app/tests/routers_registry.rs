//! The router registry (`moegrad::moe::ROUTERS`) is the one list of routers: `moegrad routers
//! --json` prints every router with its options, an unknown name's error lists the valid ones,
//! and docs/routers.md's table names every router.

use moegrad::Device;
use moegrad::moe::{OptionKind, ROUTERS};
use moegrad::moe::{ROUTER_NAMES, RouterConfig, build_router};

/// Runs the `moegrad` binary; returns (exit code, stdout, stderr).
fn moegrad(args: &[&str]) -> (Option<i32>, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_moegrad"))
        .args(args)
        .output()
        .expect("run moegrad");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn routers_json_lists_every_router_with_its_options() {
    let (code, stdout, stderr) = moegrad(&["routers", "--json"]);
    assert_eq!(code, Some(0), "stderr: {stderr}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON object");
    let listed = v["routers"].as_array().expect("a routers array");
    let names: Vec<&str> = listed.iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(names, ROUTER_NAMES, "every router, in registry order");
    for (r, spec) in listed.iter().zip(ROUTERS) {
        assert!(!r["summary"].as_str().unwrap().is_empty(), "{}", spec.name);
        let opts = r["options"].as_array().unwrap();
        let keys: Vec<&str> = opts.iter().map(|o| o["key"].as_str().unwrap()).collect();
        assert_eq!(keys, spec.option_keys(), "options of {}", spec.name);
        assert_eq!(
            r["selection_bias"].as_bool(),
            Some(moegrad::moe::BIASABLE_ROUTERS.contains(&spec.name)),
            "{}",
            spec.name
        );
        for o in opts {
            for field in ["type", "default", "help"] {
                assert!(
                    o[field].as_str().is_some_and(|s| !s.is_empty()),
                    "{}.{} has no {field}",
                    spec.name,
                    o["key"]
                );
            }
        }
    }
    // a few options the routers are known to take, with their defaults and types
    let option = |router: &str, key: &str| {
        let r = listed.iter().find(|r| r["name"] == router).unwrap();
        let o = r["options"]
            .as_array()
            .unwrap()
            .iter()
            .find(|o| o["key"] == key);
        o.map(|o| {
            (
                o["type"].as_str().unwrap().to_string(),
                o["default"].as_str().unwrap().to_string(),
            )
        })
    };
    assert_eq!(
        option("threshold", "t"),
        Some(("number".into(), "0.9".into()))
    );
    assert_eq!(
        option("moesart", "strategy"),
        Some(("i|ii|iii|eq3".into(), "eq3".into()))
    );
    assert_eq!(
        option("reinforce", "baseline"),
        Some(("bool".into(), "true".into()))
    );
    assert_eq!(
        option("sparsemixer-v2", "top"),
        Some(("count".into(), "k".into()))
    );
    assert_eq!(option("topk", "tau"), None);

    // the text form names every router too
    let (code, text, _) = moegrad(&["routers"]);
    assert_eq!(code, Some(0));
    for name in ROUTER_NAMES {
        assert!(
            text.lines().any(|l| l.starts_with(&format!("{name} "))),
            "{name} missing:\n{text}"
        );
    }
}

#[test]
fn an_unknown_router_is_an_error_listing_the_valid_ones() {
    let cfg = RouterConfig::new(4, 4, 2);
    let err = build_router("no-such-router", &cfg, Device::cpu())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("\"no-such-router\""), "{err}");
    for name in ROUTER_NAMES {
        assert!(err.contains(name), "{name} missing from: {err}");
    }
    // on the command line, clap lists the same names
    let (code, _, stderr) = moegrad(&["train", "--model", "moe-mlp", "--router", "no-such-router"]);
    assert_eq!(code, Some(2), "{stderr}");
    for name in ROUTER_NAMES {
        assert!(stderr.contains(name), "{name} missing from: {stderr}");
    }
}

#[test]
fn an_unlisted_option_is_rejected_naming_the_listed_ones() {
    for spec in ROUTERS {
        let mut cfg = RouterConfig::new(4, 4, 2);
        cfg.options.insert("no_such_option".into(), "1".into());
        let err = build_router(spec.name, &cfg, Device::cpu())
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("no_such_option"), "{}: {err}", spec.name);
        for o in spec.options {
            assert!(
                err.contains(o.key),
                "{}: {} missing from: {err}",
                spec.name,
                o.key
            );
        }
        if spec.options.is_empty() {
            assert!(err.contains("accepts none"), "{}: {err}", spec.name);
        }
        for o in spec.options {
            if let OptionKind::Choice(words) = o.kind {
                assert!(words.contains(&o.default), "{}.{}", spec.name, o.key);
            }
        }
    }
}

#[test]
fn docs_routers_table_names_every_router() {
    let path = concat!(
        concat!(env!("CARGO_MANIFEST_DIR"), "/.."),
        "/docs/routers.md"
    );
    let text = std::fs::read_to_string(path).expect("docs/routers.md");
    // the first column of the rows of the table headed `| name | experts per token | ...`
    let documented: Vec<String> = text
        .lines()
        .skip_while(|l| !l.starts_with("| name |"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .flat_map(|l| {
            let first = l.trim_start_matches('|').split('|').next().unwrap_or("");
            first
                .split(',')
                .map(|n| n.trim().trim_matches('`').to_string())
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(!documented.is_empty(), "no router table in docs/routers.md");
    for name in ROUTER_NAMES {
        assert!(
            documented.iter().any(|d| d == name),
            "router {name} is missing from the table in docs/routers.md"
        );
    }
    for d in &documented {
        assert!(
            ROUTER_NAMES.contains(&d.as_str()),
            "docs/routers.md's table names {d:?}, which is not a router"
        );
    }
}

#[test]
fn names_are_unique_and_options_well_formed() {
    for (i, r) in ROUTERS.iter().enumerate() {
        assert!(
            !ROUTERS[..i].iter().any(|o| o.name == r.name),
            "{} twice",
            r.name
        );
        assert!(!r.summary.is_empty(), "{} has no summary", r.name);
        for o in r.options {
            assert!(!o.help.is_empty(), "{}.{} has no help", r.name, o.key);
        }
    }
}

/// Every option a spec lists is one the router's constructor accepts at its default (or, for a
/// default taken from elsewhere such as `k`, at a valid value), so the registry cannot list a key
/// the router rejects.
#[test]
fn every_listed_option_is_accepted_at_its_default() {
    for r in ROUTERS {
        for o in r.options {
            let literal = match o.kind {
                OptionKind::Number => o.default.parse::<f64>().is_ok(),
                OptionKind::Count => o.default.parse::<usize>().is_ok(),
                OptionKind::Bool => o.default.parse::<bool>().is_ok(),
                OptionKind::Choice(_) => true,
            };
            let value = match (literal, o.kind) {
                (true, _) => o.default,
                (false, OptionKind::Count) => "1",
                (false, _) => "0.5",
            };
            let mut cfg = RouterConfig::new(4, 4, 2);
            cfg.options.insert(o.key.into(), value.into());
            if let Err(e) = build_router(r.name, &cfg, Device::cpu()) {
                panic!("{} {}={value}: {e}", r.name, o.key);
            }
        }
    }
}

/// The defaults a spec lists are the ones its router uses: for every option whose listed default
/// is a literal value, a router given that value explicitly routes a batch exactly as one given
/// no options (same experts, weights, probabilities and auxiliary loss), from the same seed. A
/// default changed in a router's code but not in its spec (or the reverse) fails here.
#[test]
fn the_listed_literal_defaults_are_the_routers_defaults() {
    use moegrad::Tensor;
    let (d, n, k, t) = (6, 4, 2, 24);
    let x: Vec<f32> = (0..t * d)
        .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.13)
        .collect();
    let x = Tensor::from_f32(x, &[t, d], Device::cpu()).unwrap();
    let outcome = |name: &str, cfg: &RouterConfig| -> Vec<Vec<f64>> {
        let router = build_router(name, cfg, Device::cpu()).unwrap();
        // the same spread-out parameters for both routers, away from the initial values at
        // which some settings make no difference (DSelect-k's smooth-step at 0)
        router.visit_params("", &mut |_, p| {
            let v = p.get();
            let values: Vec<f64> = (0..v.numel())
                .map(|i| ((i * 29 % 17) as f64 - 8.0) * 0.21)
                .collect();
            let spread = Tensor::from_f64(values, v.shape(), Device::cpu())
                .and_then(|s| s.to_dtype(v.dtype()))
                .unwrap();
            p.set(spread).unwrap();
        });
        let r = router.route(&x).unwrap();
        let mut parts = vec![
            r.expert.to_vec_f64().unwrap(),
            r.weight.to_vec_f64().unwrap(),
            r.valid.to_vec_f64().unwrap(),
            r.probs.to_vec_f64().unwrap(),
        ];
        if let Some(aux) = &r.aux_loss {
            parts.push(aux.to_vec_f64().unwrap());
        }
        parts
    };
    let mut checked = 0;
    for r in ROUTERS {
        let implicit = outcome(r.name, &RouterConfig::new(d, n, k));
        for o in r.options {
            let literal = match o.kind {
                OptionKind::Number => o.default.parse::<f64>().is_ok(),
                OptionKind::Count => o.default.parse::<usize>().is_ok(),
                OptionKind::Bool => o.default.parse::<bool>().is_ok(),
                OptionKind::Choice(words) => words.contains(&o.default),
            };
            if !literal {
                continue; // taken from elsewhere (`k`, `n`, `--jitter`)
            }
            let mut cfg = RouterConfig::new(d, n, k);
            cfg.options.insert(o.key.into(), o.default.into());
            let explicit = outcome(r.name, &cfg);
            assert_eq!(
                explicit, implicit,
                "{} {}={}: routes differently from the router with no options",
                r.name, o.key, o.default
            );
            checked += 1;
        }
    }
    assert!(checked >= 15, "only {checked} literal defaults checked");
}

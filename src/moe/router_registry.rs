//! The router registry: one [`RouterSpec`] per command-line router name, in [`ROUTERS`], and
//! [`build_router`], which builds a router from it by name.
//!
//! Each router file declares the spec of the names it serves (its name, a one-line summary, its
//! `--router-opt` options with type, default and help, and its constructor) next to its code;
//! the `router_files!` list in `src/moe/routers/mod.rs` names each file once, with its specs, and
//! [`ROUTERS`] is that list. Everything that needs to know the routers
//! reads this list: [`build_router`], [`ROUTER_NAMES`] (the CLI's `--router`
//! validation and `--help`), the error that names the valid routers, the check of
//! `--router-opt` keys, the estimator lab's default list
//! ([`crate::estimator_lab::ESTIMATOR_NAMES`]) and `moegrad routers [--json]`.
//!
//! Adding a router is one new file under `src/moe/routers/` (a struct implementing
//! [`crate::moe::Router`] and a `pub const SPEC: RouterSpec`) plus one line in `router_files!`
//! (`my_router => [SPEC],`); see `docs/adding-a-router.md`.

use super::{Router, RouterConfig};
use crate::{Device, Error, Result};

/// The type of a router option's value, as `RouterConfig::opt_*` parses it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptionKind {
    /// a finite number (`RouterConfig::opt_f64`)
    Number,
    /// a whole number ≥ 0 (`RouterConfig::opt_usize`)
    Count,
    /// `true`/`false` (also `1`/`0`, `yes`/`no`; `RouterConfig::opt_bool`)
    Bool,
    /// one of the listed words (`RouterConfig::opt_str`)
    Choice(&'static [&'static str]),
}

impl OptionKind {
    /// The type as `moegrad routers` shows it: `number`, `count`, `bool` or `a|b|c`.
    pub fn describe(self) -> String {
        match self {
            OptionKind::Number => "number".into(),
            OptionKind::Count => "count".into(),
            OptionKind::Bool => "bool".into(),
            OptionKind::Choice(words) => words.join("|"),
        }
    }
}

/// One `--router-opt key=value` option of a router.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouterOption {
    /// the key
    pub key: &'static str,
    /// the type of the value
    pub kind: OptionKind,
    /// the default, as text: a value of `kind`, or what it is taken from (`k`, `n`, `--jitter`)
    pub default: &'static str,
    /// one line of help
    pub help: &'static str,
}

/// Everything the crate and the CLI need to know about one router name.
///
/// # Example
/// ```
/// use moegrad::moe::{find_router, ROUTERS};
/// use moegrad::moe::RouterConfig;
/// use moegrad::Device;
///
/// let spec = find_router("threshold").unwrap();
/// assert!(spec.options.iter().any(|o| o.key == "max_k"));
/// let router = (spec.build)(&RouterConfig::new(8, 4, 2), Device::cpu()).unwrap();
/// assert_eq!(router.name(), "threshold");
/// assert!(ROUTERS.iter().any(|r| r.name == "topk"));
/// ```
#[derive(Clone, Copy)]
pub struct RouterSpec {
    /// the command-line name (`--router NAME`)
    pub name: &'static str,
    /// what it does, in one line
    pub summary: &'static str,
    /// its `--router-opt` options, in the order its errors list them
    pub options: &'static [RouterOption],
    /// builds it (after [`crate::moe::build_router`] has checked `k` and the option keys)
    pub build: fn(&RouterConfig, Device) -> Result<Box<dyn Router>>,
    /// `Some(i)`: the estimator lab runs it by default, as row `i` of its table
    pub estimator_lab: Option<usize>,
}

impl RouterSpec {
    /// The option keys, in order.
    pub fn option_keys(&self) -> Vec<&'static str> {
        self.options.iter().map(|o| o.key).collect()
    }
}

impl std::fmt::Debug for RouterSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterSpec")
            .field("name", &self.name)
            .field("summary", &self.summary)
            .field("options", &self.options)
            .field("estimator_lab", &self.estimator_lab)
            .finish_non_exhaustive()
    }
}

/// Every router, in the order `--help` and error messages list them: the entries of the one-line
/// per file list in `src/moe/routers/mod.rs` (`router_files!`).
pub const ROUTERS: &[RouterSpec] = super::routers::ROUTER_SPECS;

const ROUTER_COUNT: usize = ROUTERS.len();

const NAMES: [&str; ROUTER_COUNT] = {
    let mut names = [""; ROUTER_COUNT];
    let mut i = 0;
    while i < ROUTER_COUNT {
        names[i] = ROUTERS[i].name;
        i += 1;
    }
    names
};

/// Every router name [`crate::moe::build_router`] accepts, in [`ROUTERS`] order.
pub const ROUTER_NAMES: &[&str] = &NAMES;

const LAB_COUNT: usize = {
    let mut count = 0;
    let mut i = 0;
    while i < ROUTER_COUNT {
        if ROUTERS[i].estimator_lab.is_some() {
            count += 1;
        }
        i += 1;
    }
    count
};

const LAB_NAMES: [&str; LAB_COUNT] = {
    let mut names = [""; LAB_COUNT];
    let mut i = 0;
    while i < ROUTER_COUNT {
        if let Some(row) = ROUTERS[i].estimator_lab {
            // a row out of range or given twice fails the build here or in the check below
            names[row] = ROUTERS[i].name;
        }
        i += 1;
    }
    let mut row = 0;
    while row < LAB_COUNT {
        assert!(
            !names[row].is_empty(),
            "estimator_lab rows must be 0, 1, 2, ... without gaps"
        );
        row += 1;
    }
    names
};

/// The routers the estimator lab runs by default, in the order of its table (the registry
/// entries with `estimator_lab: Some(row)`).
pub const LAB_ROUTER_NAMES: &[&str] = &LAB_NAMES;

/// The routers that keep a selection-only bias when asked ([`crate::moe::Router::selection_bias`]),
/// so `--balance aux-free` and `quantile` work with them: the ones that choose their experts as
/// the top k of a score. (The others sample, threshold, or do not choose per token; a test
/// holds this list to what each router does.)
pub const BIASABLE_ROUTERS: &[&str] = &[
    "topk",
    "topk-noisy",
    "topk-unnorm",
    "switch",
    "vmoe",
    "smoe",
    "xmoe-cosine",
    "deepseek-v3",
    "sigmoid-topk",
    "softplus-topk",
    "default-moe",
];

/// The spec of router `name`; an unknown name is an error listing the valid ones.
pub fn find_router(name: &str) -> Result<&'static RouterSpec> {
    ROUTERS.iter().find(|r| r.name == name).ok_or_else(|| {
        Error::Invalid(format!(
            "unknown router {name:?}; expected one of {}",
            ROUTER_NAMES.join(", ")
        ))
    })
}

/// Builds a router by its command-line name, from its entry in [`ROUTERS`].
///
/// Errors name what is wrong: an unknown name (listing the valid ones), `k` outside
/// `1..=experts`, an option the router does not accept (listing those it does), or whatever
/// the router's own constructor rejects.
pub fn build_router(name: &str, cfg: &RouterConfig, device: Device) -> Result<Box<dyn Router>> {
    if cfg.k == 0 || cfg.k > cfg.experts {
        return Err(Error::Invalid(format!(
            "--k {} must be between 1 and the number of experts {}",
            cfg.k, cfg.experts
        )));
    }
    let spec = find_router(name)?;
    cfg.check_options(name, &spec.option_keys())?;
    (spec.build)(cfg, device)
}

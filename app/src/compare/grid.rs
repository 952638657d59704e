//! The grid of `moegrad compare`: a fixed part (train flags every cell shares) and axes (router,
//! seed, any other train flag, or named variants that set several flags at once), crossed into
//! cells.
//!
//! A grid comes from the command line (`--routers topk,softmax --seeds 1,2 --set k=2,4` plus
//! train flags) or from a grid file ([`Grid::from_file`], TOML or JSON):
//!
//! ```toml
//! routers = ["topk", "softmax"]      # the router axis (--routers)
//! seeds = [1, 2, 3]                  # the seed axis, always last (--seeds)
//! metric = "test_loss"               # optional: the bar chart's and the curves' metric
//! target = "test_loss=0.5"           # optional: steps to reach it (--target)
//!
//! [train]                            # the fixed part: flag = value, as on the command line
//! data = "mnist"
//! model = "moe-mlp"
//! epochs = 1
//!
//! [set]                              # more axes: flag = [values] (--set k=2,4)
//! k = [2, 4]
//!
//! [[variants]]                       # an axis whose points set several flags each
//! name = "dselect-k γ=10"
//! router = "dselect-k"
//! router-opt = "gamma=10"
//! ```
//!
//! [`Grid::cells`] crosses the axes (variants, routers, the `[set]` axes in order, seeds last)
//! into [`Cell`]s, each with a canonical list of train flags and a directory name derived from
//! its coordinates alone, so that the same cell always lands in the same directory. Nothing here
//! checks that a flag or value is one `train` accepts: the caller parses every cell's flags with
//! the train command's own parser before anything runs (see `compare::run`).

use moegrad::{Error, Result};
use std::path::Path;

/// The most cells one grid may have (each is a training run; the cells are listed and checked
/// before any runs).
pub const MAX_CELLS: usize = 4096;

/// The axis of seeds: cells that differ only along it form one group.
pub const SEED_AXIS: &str = "seed";
/// The axis of `[[variants]]`.
pub const VARIANT_AXIS: &str = "variant";
/// Train flags that `compare` sets itself for each cell, or that would defeat it; a grid may
/// not set them.
pub const RESERVED_FLAGS: &[&str] = &[
    "out",
    "json",
    "resume",
    "overwrite",
    "allow-config-change",
    "help",
];
/// Train flags that may be given more than once (their values add up instead of conflicting).
pub const REPEATABLE_FLAGS: &[&str] = &["router-opt"];

/// One train flag with its value: `--k 2` is `Setting { flag: "k", value: Some("2") }`, a bare
/// switch has no value.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Setting {
    /// the flag's name without the leading `--` (`expert-hidden`)
    pub flag: String,
    /// its value, None for a switch given alone
    pub value: Option<String>,
}

impl Setting {
    /// A flag with a value.
    pub fn new(flag: &str, value: &str) -> Setting {
        Setting {
            flag: normalise_flag(flag),
            value: Some(value.to_string()),
        }
    }

    /// The setting as command-line words: `["--k", "2"]`.
    pub fn words(&self) -> Vec<String> {
        let mut w = vec![format!("--{}", self.flag)];
        w.extend(self.value.clone());
        w
    }

    /// `k=2` (or `flag` for a switch), for messages and labels.
    pub fn label(&self) -> String {
        match &self.value {
            Some(v) => format!("{}={v}", self.flag),
            None => self.flag.clone(),
        }
    }
}

/// One point of an axis: its label (in tables and directory names) and the settings it adds.
#[derive(Clone, Debug, PartialEq)]
pub struct Point {
    /// `topk` on the router axis; a variant's `name`
    pub label: String,
    /// the flags this point sets
    pub settings: Vec<Setting>,
}

/// An axis of the grid: a name (a train flag such as `router`, or `variant`) and its points.
#[derive(Clone, Debug, PartialEq)]
pub struct Axis {
    /// the column name in tables: the flag (`router`, `k`, `seed`) or `variant`
    pub name: String,
    /// the values, in the order given
    pub points: Vec<Point>,
}

impl Axis {
    /// The axis of one flag taking each of `values` (`--set k=2,4`).
    pub fn of_flag(flag: &str, values: &[String]) -> Axis {
        let flag = normalise_flag(flag);
        Axis {
            points: values
                .iter()
                .map(|v| Point {
                    label: v.clone(),
                    settings: vec![Setting::new(&flag, v)],
                })
                .collect(),
            name: flag,
        }
    }
}

/// A grid of train runs (see the module docs).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Grid {
    /// the settings every cell shares
    pub fixed: Vec<Setting>,
    /// the axes, crossed in this order
    pub axes: Vec<Axis>,
    /// the final metric of the bar chart and the curves (default: the test or validation loss)
    pub metric: Option<String>,
    /// `METRIC=VALUE`: report the steps each cell needed to reach it
    pub target: Option<String>,
}

/// One run of the grid.
#[derive(Clone, Debug, PartialEq)]
pub struct Cell {
    /// the directory name under `--out`, derived from `coords` alone
    pub name: String,
    /// `(axis, label)` for every axis, in axis order
    pub coords: Vec<(String, String)>,
    /// the train flags of this run, in a canonical order (sorted by flag), without `--out`
    pub argv: Vec<String>,
}

impl Cell {
    /// The coordinates without the seed: cells with equal groups are aggregated together.
    pub fn group(&self) -> Vec<(String, String)> {
        self.coords
            .iter()
            .filter(|(a, _)| a != SEED_AXIS)
            .cloned()
            .collect()
    }

    /// The seed's label, when the grid has a seed axis.
    pub fn seed(&self) -> Option<&str> {
        self.coords
            .iter()
            .find(|(a, _)| a == SEED_AXIS)
            .map(|(_, l)| l.as_str())
    }

    /// `router=topk seed=1`, for messages.
    pub fn label(&self) -> String {
        if self.coords.is_empty() {
            return "(the only cell)".into();
        }
        self.coords
            .iter()
            .map(|(a, l)| format!("{a}={l}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// `--expert_hidden` and `expert-hidden` are both the flag `expert-hidden`.
pub fn normalise_flag(flag: &str) -> String {
    flag.trim().trim_start_matches("--").replace('_', "-")
}

/// Pairs command-line words into settings: `--flag value`, `--flag=value`, or a bare `--flag`
/// (a switch, when the next word is another flag or there is none).
///
/// # Errors
/// A word where a flag was expected (`5` in `--k 2 5`), naming it.
///
/// # Example
/// ```
/// use moegrad_cli::compare::grid::parse_train_words;
/// let words: Vec<String> = ["--data", "mnist", "--lr=0.01", "--json"].map(String::from).into();
/// let s = parse_train_words(&words).unwrap();
/// assert_eq!(s.len(), 3);
/// assert_eq!(s[1].label(), "lr=0.01");
/// assert_eq!(s[2].value, None);
/// ```
pub fn parse_train_words(words: &[String]) -> Result<Vec<Setting>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < words.len() {
        let w = &words[i];
        let Some(rest) = w.strip_prefix("--").filter(|r| !r.is_empty()) else {
            return Err(Error::Invalid(format!(
                "compare: {w:?} is not a train flag (train flags are written --name value){}",
                if i > 0 {
                    format!(", after {:?}", words[i - 1])
                } else {
                    String::new()
                }
            )));
        };
        if let Some((flag, value)) = rest.split_once('=') {
            out.push(Setting::new(flag, value));
            i += 1;
            continue;
        }
        match words.get(i + 1) {
            Some(v) if !v.starts_with("--") => {
                out.push(Setting::new(rest, v));
                i += 2;
            }
            _ => {
                out.push(Setting {
                    flag: normalise_flag(rest),
                    value: None,
                });
                i += 1;
            }
        }
    }
    Ok(out)
}

/// Splits `k=2,4` (or `--k=2,4`) into the axis of flag `k` with values 2 and 4.
///
/// # Errors
/// No `=`, an empty flag name, or an empty list of values.
pub fn parse_set(spec: &str) -> Result<Axis> {
    let Some((flag, values)) = spec.split_once('=') else {
        return Err(Error::Invalid(format!(
            "compare: --set {spec:?} is not of the form FLAG=V1,V2 (e.g. --set k=2,4)"
        )));
    };
    let flag = normalise_flag(flag);
    if flag.is_empty() {
        return Err(Error::Invalid(format!(
            "compare: --set {spec:?} names no flag"
        )));
    }
    let values = split_list(values);
    check_axis_values(&flag, &values, "--set")?;
    Ok(Axis::of_flag(&flag, &values))
}

/// `a, b,c` → `["a", "b", "c"]`; an empty string gives an empty list.
pub fn split_list(s: &str) -> Vec<String> {
    if s.trim().is_empty() {
        return Vec::new();
    }
    s.split(',').map(|v| v.trim().to_string()).collect()
}

fn check_axis_values(axis: &str, values: &[String], source: &str) -> Result<()> {
    if values.is_empty() || values.iter().any(|v| v.is_empty()) {
        return Err(Error::Invalid(format!(
            "compare: the {axis} axis ({source}) has an empty value list or an empty value: {values:?}; give at least one value"
        )));
    }
    Ok(())
}

impl Grid {
    /// The grid of the command line: `train` words are the fixed part, `--routers`, `--seeds`
    /// and every `--set FLAG=V1,V2` an axis. An axis left empty on the command line (no
    /// `--routers`) is no axis; one given empty (`--routers ""`) is an error.
    ///
    /// # Errors
    /// Malformed words or `--set` specifications, an empty axis.
    pub fn from_flags(
        train: &[String],
        routers: Option<&[String]>,
        seeds: Option<&[String]>,
        sets: &[String],
    ) -> Result<Grid> {
        let mut grid = Grid {
            fixed: parse_train_words(train)?,
            ..Grid::default()
        };
        if let Some(r) = routers {
            check_axis_values("router", r, "--routers")?;
            grid.axes.push(Axis::of_flag("router", r));
        }
        for s in sets {
            grid.axes.push(parse_set(s)?);
        }
        if let Some(s) = seeds {
            check_axis_values(SEED_AXIS, s, "--seeds")?;
            grid.axes.push(Axis::of_flag(SEED_AXIS, s));
        }
        Ok(grid)
    }

    /// Reads a grid file: TOML, or JSON when the name ends in `.json` (the same keys; see the
    /// module docs).
    ///
    /// # Errors
    /// An unreadable file, a syntax error, an unknown key, a value of the wrong kind, an empty
    /// axis; each names the file and the key.
    pub fn from_file(path: &Path) -> Result<Grid> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Io(format!("--grid {}: {e}", path.display())))?;
        let is_json = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("json"));
        let table: toml::Table = if is_json {
            serde_json::from_str(&text).map_err(|e| {
                Error::Invalid(format!("--grid {}: not a grid file: {e}", path.display()))
            })?
        } else {
            text.parse().map_err(|e: toml::de::Error| {
                // toml's own message ("invalid array", "expected `]`") at the line and column
                // its span starts (toml's rendered first line gives only the place)
                let what = e.message().trim().replace('\n', "; ");
                let at = e
                    .span()
                    .map(|s| {
                        let before = &text[..s.start.min(text.len())];
                        let line = before.matches('\n').count() + 1;
                        let column =
                            before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
                        format!(" at line {line}, column {column}")
                    })
                    .unwrap_or_default();
                Error::Invalid(format!(
                    "--grid {}: not a TOML grid file{at}: {what}",
                    path.display()
                ))
            })?
        };
        Grid::from_table(&table).map_err(|e| prefix_error(&format!("--grid {}", path.display()), e))
    }

    /// The grid of a parsed grid file (see the module docs for the keys).
    fn from_table(table: &toml::Table) -> Result<Grid> {
        let mut grid = Grid::default();
        let mut routers = None;
        let mut seeds = None;
        let mut variants = None;
        let mut sets = Vec::new();
        for (key, value) in table {
            match key.as_str() {
                "description" => {}
                "metric" => grid.metric = Some(scalar(key, value)?),
                "target" => grid.target = Some(scalar(key, value)?),
                "routers" => routers = Some(Axis::of_flag("router", &list(key, value)?)),
                "seeds" => seeds = Some(Axis::of_flag(SEED_AXIS, &list(key, value)?)),
                "train" => {
                    for (flag, v) in sub_table(key, value)? {
                        grid.fixed.extend(settings_of(flag, v)?);
                    }
                }
                "set" => {
                    for (flag, v) in sub_table(key, value)? {
                        let values = list(&format!("set.{flag}"), v)?;
                        sets.push(Axis::of_flag(flag, &values));
                    }
                }
                "variants" => variants = Some(variant_axis(value)?),
                other => {
                    return Err(Error::Invalid(format!(
                        "unknown key {other:?}; a grid file has description, metric, target, routers, seeds, [train], [set] and [[variants]]"
                    )));
                }
            }
        }
        grid.axes.extend(variants);
        grid.axes.extend(routers);
        grid.axes.extend(sets);
        grid.axes.extend(seeds);
        Ok(grid)
    }

    /// This grid with `cli`'s parts laid over it: a fixed flag of `cli` replaces this grid's
    /// fixed flag of the same name, an axis of `cli` replaces the axis of the same name (or is
    /// added before the seeds), and `cli`'s metric and target replace these. This is how
    /// `--grid FILE --epochs 1 --seeds 1` shortens a shipped grid.
    pub fn overridden_by(mut self, cli: Grid) -> Grid {
        let replaced: Vec<&str> = cli.fixed.iter().map(|s| s.flag.as_str()).collect();
        self.fixed.retain(|s| !replaced.contains(&s.flag.as_str()));
        self.fixed.extend(cli.fixed.iter().cloned());
        for axis in cli.axes {
            if let Some(a) = self.axes.iter_mut().find(|a| a.name == axis.name) {
                *a = axis;
            } else {
                let at = self
                    .axes
                    .iter()
                    .position(|a| a.name == SEED_AXIS)
                    .unwrap_or(self.axes.len());
                self.axes.insert(at, axis);
            }
        }
        if cli.metric.is_some() {
            self.metric = cli.metric;
        }
        if cli.target.is_some() {
            self.target = cli.target;
        }
        self
    }

    /// Every cell of the grid, axes crossed in order (the last axis varies fastest).
    ///
    /// # Errors
    /// A reserved flag (`--out`, `--json`, `--resume`, ...), a flag set both by the fixed part
    /// and an axis (or by two axes), an empty axis, the same value twice on one axis, two
    /// values whose directory names would clash, more than [`MAX_CELLS`] cells; each names the
    /// flag or axis.
    pub fn cells(&self) -> Result<Vec<Cell>> {
        for s in self.fixed.iter().chain(
            self.axes
                .iter()
                .flat_map(|a| a.points.iter().flat_map(|p| &p.settings)),
        ) {
            if RESERVED_FLAGS.contains(&s.flag.as_str()) {
                return Err(Error::Invalid(format!(
                    "compare: --{} cannot be part of a grid: compare gives each cell its own --out under the grid's --out, reads its --json, and resumes cells itself",
                    s.flag
                )));
            }
        }
        // who sets each flag: the fixed part or one axis, never two
        let mut owner: Vec<(String, String)> = Vec::new();
        let mut claim = |flag: &str, by: &str| -> Result<()> {
            if REPEATABLE_FLAGS.contains(&flag) {
                return Ok(());
            }
            match owner.iter().find(|(f, _)| f == flag) {
                Some((_, other)) if other != by => Err(Error::Invalid(format!(
                    "compare: --{flag} is set both by {other} and by {by}; set each flag in one place"
                ))),
                Some(_) => Ok(()),
                None => {
                    owner.push((flag.to_string(), by.to_string()));
                    Ok(())
                }
            }
        };
        for (i, s) in self.fixed.iter().enumerate() {
            if self.fixed[..i].iter().any(|t| t.flag == s.flag)
                && !REPEATABLE_FLAGS.contains(&s.flag.as_str())
            {
                return Err(Error::Invalid(format!(
                    "compare: --{} is given twice in the fixed part",
                    s.flag
                )));
            }
            claim(&s.flag, "the fixed train flags")?;
        }
        for axis in &self.axes {
            if axis.points.is_empty() {
                return Err(Error::Invalid(format!(
                    "compare: the {} axis is empty; give it at least one value",
                    axis.name
                )));
            }
            let by = format!("the {} axis", axis.name);
            for (i, p) in axis.points.iter().enumerate() {
                if axis.points[..i].iter().any(|q| q.label == p.label) {
                    return Err(Error::Invalid(format!(
                        "compare: the {} axis has the value {:?} twice",
                        axis.name, p.label
                    )));
                }
                let dir = dir_component(&p.label);
                if let Some(q) = axis.points[..i]
                    .iter()
                    .find(|q| dir_component(&q.label) == dir)
                {
                    return Err(Error::Invalid(format!(
                        "compare: the {} axis's values {:?} and {:?} would share a directory name; rename one",
                        axis.name, q.label, p.label
                    )));
                }
                for s in &p.settings {
                    claim(&s.flag, &by)?;
                }
            }
        }
        if self.axes.iter().filter(|a| a.name == SEED_AXIS).count() > 1
            || self
                .axes
                .iter()
                .enumerate()
                .any(|(i, a)| self.axes[..i].iter().any(|b| b.name == a.name))
        {
            return Err(Error::Invalid(
                "compare: two axes have the same name".into(),
            ));
        }
        let count = self
            .axes
            .iter()
            .try_fold(1usize, |n, a| n.checked_mul(a.points.len()))
            .filter(|&n| n <= MAX_CELLS);
        let Some(count) = count else {
            let sizes: Vec<String> = self
                .axes
                .iter()
                .map(|a| format!("{} {}", a.points.len(), a.name))
                .collect();
            return Err(Error::Invalid(format!(
                "compare: the grid crosses {} values, more than the {MAX_CELLS} cells compare runs in one grid; split it",
                sizes.join(" × ")
            )));
        };
        let mut cells = Vec::with_capacity(count);
        let mut index = vec![0usize; self.axes.len()];
        loop {
            let points: Vec<(&Axis, &Point)> = self
                .axes
                .iter()
                .zip(&index)
                .map(|(a, &i)| (a, &a.points[i]))
                .collect();
            let mut settings = self.fixed.clone();
            for (_, p) in &points {
                settings.extend(p.settings.iter().cloned());
            }
            // stable: repeated flags (router-opt) keep their order
            settings.sort_by(|a, b| a.flag.cmp(&b.flag));
            let coords: Vec<(String, String)> = points
                .iter()
                .map(|(a, p)| (a.name.clone(), p.label.clone()))
                .collect();
            cells.push(Cell {
                name: cell_dir_name(&coords),
                coords,
                argv: settings.iter().flat_map(Setting::words).collect(),
            });
            // the next index, last axis fastest
            let mut d = self.axes.len();
            loop {
                if d == 0 {
                    return Ok(cells);
                }
                d -= 1;
                index[d] += 1;
                if index[d] < self.axes[d].points.len() {
                    break;
                }
                index[d] = 0;
            }
        }
    }
}

/// The directory name of a cell: `router-topk_seed-1` (`cell` for a grid without axes).
pub fn cell_dir_name(coords: &[(String, String)]) -> String {
    if coords.is_empty() {
        return "cell".into();
    }
    coords
        .iter()
        .map(|(a, l)| format!("{}-{}", dir_component(a), dir_component(l)))
        .collect::<Vec<_>>()
        .join("_")
}

/// A label as a file-name part: ASCII letters, digits, `.`, `+` and `-` are kept, anything else
/// becomes `-`; when that changed the label (or it is long), a hash of the exact label is
/// appended so that two labels never share a name.
pub fn dir_component(label: &str) -> String {
    let clean: String = label
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '+' | '-') {
                c
            } else {
                '-'
            }
        })
        .collect();
    let clean = clean.trim_matches('-');
    if clean == label && !label.is_empty() && label.len() <= 40 && !label.starts_with('.') {
        return clean.to_string();
    }
    let short: String = clean.chars().take(32).collect();
    format!("{short}-{:08x}", fnv1a(label.as_bytes()) as u32)
}

/// FNV-1a, 64 bits: a fixed hash, so directory names do not change between builds.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Puts `context: ` before an error's message, keeping its kind.
pub(crate) fn prefix_error(context: &str, e: Error) -> Error {
    match e {
        Error::Shape(m) => Error::Shape(format!("{context}: {m}")),
        Error::DType(m) => Error::DType(format!("{context}: {m}")),
        Error::Device(m) => Error::Device(format!("{context}: {m}")),
        Error::Axis(m) => Error::Axis(format!("{context}: {m}")),
        Error::Invalid(m) => Error::Invalid(format!("{context}: {m}")),
        Error::Autograd(m) => Error::Autograd(format!("{context}: {m}")),
        Error::Gradcheck(m) => Error::Gradcheck(format!("{context}: {m}")),
        Error::Gpu(m) => Error::Gpu(format!("{context}: {m}")),
        Error::Io(m) => Error::Io(format!("{context}: {m}")),
        Error::Interrupted(m) => Error::Interrupted(format!("{context}: {m}")),
    }
}

/// A scalar grid value as command-line text (`true` for a boolean true).
fn value_text(key: &str, v: &toml::Value) -> Result<String> {
    Ok(match v {
        toml::Value::String(s) => s.clone(),
        toml::Value::Integer(i) => i.to_string(),
        toml::Value::Float(f) => f.to_string(),
        toml::Value::Boolean(b) => b.to_string(),
        other => {
            return Err(Error::Invalid(format!(
                "{key}: expected a string, a number or a boolean, got {}",
                other.type_str()
            )));
        }
    })
}

fn scalar(key: &str, v: &toml::Value) -> Result<String> {
    value_text(key, v)
}

fn list(key: &str, v: &toml::Value) -> Result<Vec<String>> {
    let values = match v {
        toml::Value::Array(a) => a
            .iter()
            .map(|x| value_text(key, x))
            .collect::<Result<Vec<_>>>()?,
        other => {
            return Err(Error::Invalid(format!(
                "{key}: expected a list of values, got {}",
                other.type_str()
            )));
        }
    };
    check_axis_values(key, &values, "the grid file")?;
    Ok(values)
}

fn sub_table<'a>(key: &str, v: &'a toml::Value) -> Result<&'a toml::Table> {
    v.as_table().ok_or_else(|| {
        Error::Invalid(format!(
            "{key}: expected a table ([{key}]), got {}",
            v.type_str()
        ))
    })
}

/// The settings of `flag = value` in `[train]` or a variant: a boolean is a switch (true) or
/// nothing (false), a list repeats the flag (`router-opt = ["a=1", "b=2"]`).
fn settings_of(flag: &str, v: &toml::Value) -> Result<Vec<Setting>> {
    let name = normalise_flag(flag);
    Ok(match v {
        toml::Value::Boolean(true) => vec![Setting {
            flag: name,
            value: None,
        }],
        toml::Value::Boolean(false) => Vec::new(),
        toml::Value::Array(a) if a.len() > 1 && !REPEATABLE_FLAGS.contains(&name.as_str()) => {
            return Err(Error::Invalid(format!(
                "{flag} = [...]: a list gives --{name} several times, and only {} may be given more than once; to compare its values, put the list under [set] instead",
                REPEATABLE_FLAGS
                    .iter()
                    .map(|f| format!("--{f}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        toml::Value::Array(a) => a
            .iter()
            .map(|x| Ok(Setting::new(&name, &value_text(flag, x)?)))
            .collect::<Result<Vec<_>>>()?,
        other => vec![Setting::new(&name, &value_text(flag, other)?)],
    })
}

/// The `[[variants]]` axis: each table's `name` is its label (default: its settings), the
/// other keys its flags.
fn variant_axis(v: &toml::Value) -> Result<Axis> {
    let toml::Value::Array(items) = v else {
        return Err(Error::Invalid(format!(
            "variants: expected a list of tables ([[variants]]), got {}",
            v.type_str()
        )));
    };
    let mut points = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let t = item.as_table().ok_or_else(|| {
            Error::Invalid(format!(
                "variants[{i}]: expected a table, got {}",
                item.type_str()
            ))
        })?;
        let mut label = None;
        let mut settings = Vec::new();
        for (k, x) in t {
            if k == "name" {
                label = Some(value_text("variants.name", x)?);
            } else {
                settings.extend(settings_of(k, x)?);
            }
        }
        if settings.is_empty() {
            return Err(Error::Invalid(format!(
                "variants[{i}] sets no flag; a variant is a set of train flags, e.g. router = \"topk\""
            )));
        }
        let label = label.unwrap_or_else(|| {
            settings
                .iter()
                .map(Setting::label)
                .collect::<Vec<_>>()
                .join(" ")
        });
        points.push(Point { label, settings });
    }
    if points.is_empty() {
        return Err(Error::Invalid(
            "variants: the list is empty; give at least one [[variants]] table".into(),
        ));
    }
    Ok(Axis {
        name: VARIANT_AXIS.into(),
        points,
    })
}

//! The output directory of a training run (`--out`), claimed before anything is written to it:
//!
//! * a lock file (`.moegrad.lock`, created with `create_new`, holding the PID) keeps two runs
//!   from writing the same directory at once; a lock whose process is no longer running (a run
//!   that was killed) is taken over with a note, a live one is an error naming its PID;
//! * a fresh run refuses a directory that holds an earlier run's files (metrics, checkpoint,
//!   plots) unless told `--resume` (continue it) or `--overwrite` (replace it);
//! * with `--overwrite` the earlier run's files are not deleted at once: they are moved into
//!   `.moegrad-replaced/` inside the directory, deleted when the new run has written its first
//!   checkpoint ([`OutDir::first_checkpoint_written`]), and moved back if the new run ends
//!   before that; a run killed in between leaves them there, and the next claim of the
//!   directory puts them back. So a new run that fails at its first step costs nothing;
//! * temporaries that a killed run left while writing a file atomically are deleted.
//!
//! [`default_run_dir`] picks the directory of a run given no `--out`: a new one per run under
//! `runs/`, with `runs/latest` pointing to it.
//!
//! [`super::run`] holds the [`OutDir`] for the whole run; dropping it releases the lock.

use crate::checkpoint::{process_is_running, remove_stale_temporaries};
use crate::{Error, Result};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The files a run writes to its output directory: its record (with [`is_run_file`], which
/// also counts the per-layer plots `expert_load_<layer>.svg`).
pub const RUN_FILES: &[&str] = &[
    "metrics.jsonl",
    "checkpoint.safetensors",
    "curves.svg",
    "expert_load.svg",
    "routing_heatmap.svg",
];

/// The lock file's name inside the output directory.
pub const LOCK_FILE: &str = ".moegrad.lock";

/// Where `--overwrite` keeps the earlier run's files until the new run's first checkpoint.
pub const REPLACED_DIR: &str = ".moegrad-replaced";

/// Whether `name` is one of the files a run writes ([`RUN_FILES`], or a per-layer plot
/// `expert_load_<n>.svg`).
pub fn is_run_file(name: &str) -> bool {
    RUN_FILES.contains(&name)
        || name
            .strip_prefix("expert_load_")
            .and_then(|r| r.strip_suffix(".svg"))
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// The names of the run files (see [`is_run_file`]) in `dir`, sorted.
fn run_files_in(dir: &Path) -> Result<Vec<String>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::Io(format!("{}: {e}", dir.display()))),
    };
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::Io(format!("{}: {e}", dir.display())))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if is_run_file(&name) {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

/// Moves every run file from `from` to `to` (creating `to`), replacing what is there.
fn move_run_files(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to).map_err(|e| Error::Io(format!("{}: {e}", to.display())))?;
    for name in run_files_in(from)? {
        let (a, b) = (from.join(&name), to.join(&name));
        std::fs::rename(&a, &b)
            .map_err(|e| Error::Io(format!("moving {} to {}: {e}", a.display(), b.display())))?;
    }
    Ok(())
}

/// The directory a run given no `--out` writes: `<root>/<name>-<YYYYMMDD-HHMMSS>` (UTC), with
/// `-2`, `-3`, ... added when that exists already. (`root` is `runs` on the command line.)
pub fn default_run_dir(root: &Path, name: &str) -> PathBuf {
    let stamp = utc_stamp(std::time::SystemTime::now());
    let first = root.join(format!("{name}-{stamp}"));
    if !first.exists() {
        return first;
    }
    (2..)
        .map(|i| root.join(format!("{name}-{stamp}-{i}")))
        .find(|p| !p.exists())
        .expect("an unused name")
}

/// `YYYYMMDD-HHMMSS` in UTC for `t` (the civil-from-days conversion of H. Hinnant's
/// `chrono`-compatible date algorithms).
fn utc_stamp(t: std::time::SystemTime) -> String {
    let secs = t
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}{month:02}{day:02}-{:02}{:02}{:02}",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// Points `<root>/latest` at `dir` (a relative symbolic link; on systems without them, a file
/// `latest` naming `dir`). A `latest` that is a real directory (an earlier version's default
/// `--out`) is left alone, and the returned note says so.
pub fn point_latest(root: &Path, dir: &Path) -> Result<Option<String>> {
    let latest = root.join("latest");
    let io = |e: std::io::Error| Error::Io(format!("{}: {e}", latest.display()));
    match std::fs::symlink_metadata(&latest) {
        Ok(m) if m.is_dir() => {
            return Ok(Some(format!(
                "{} is a directory (an earlier run's --out), so it was not pointed at {}",
                latest.display(),
                dir.display()
            )));
        }
        Ok(_) => std::fs::remove_file(&latest).map_err(io)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(e)),
    }
    let target = dir
        .file_name()
        .map(PathBuf::from)
        .unwrap_or(dir.to_path_buf());
    #[cfg(unix)]
    std::os::unix::fs::symlink(&target, &latest).map_err(io)?;
    #[cfg(not(unix))]
    std::fs::write(&latest, target.to_string_lossy().as_bytes()).map_err(io)?;
    Ok(None)
}

/// An output directory claimed by this process; the lock is released when it is dropped.
#[derive(Debug)]
pub struct OutDir {
    dir: PathBuf,
    lock: PathBuf,
    /// whether this value created the lock file (and so removes it when dropped)
    locked: bool,
    /// whether an earlier run's files are set aside in [`REPLACED_DIR`] by this run, waiting
    /// for its first checkpoint
    replacing: bool,
    /// what claiming the directory did that the user should hear about (a stale lock taken
    /// over, temporaries of killed runs removed)
    pub notes: Vec<String>,
}

impl OutDir {
    /// Creates `dir` if needed, takes its lock, deletes temporaries left by killed runs, puts
    /// back the files a killed `--overwrite` run had set aside, and, for a fresh run (`resume`
    /// false), refuses a directory holding an earlier run's files unless `overwrite` is set.
    ///
    /// # Errors
    /// `resume` and no directory; `dir` is a file, not a directory; the directory cannot be
    /// created; another live process holds the lock (the message names its PID); an earlier
    /// run's files are present without `resume` or `overwrite`.
    pub fn claim(dir: &Path, resume: bool, overwrite: bool) -> Result<OutDir> {
        if dir.exists() && !dir.is_dir() {
            return Err(Error::Io(format!(
                "--out {} exists and is not a directory (a run writes several files into a directory): choose a directory",
                dir.display()
            )));
        }
        if resume && !dir.is_dir() {
            return Err(Error::Io(format!(
                "--resume: --out {} is not a directory: there is no run to continue there (start one without --resume)",
                dir.display()
            )));
        }
        std::fs::create_dir_all(dir).map_err(|e| Error::Io(format!("{}: {e}", dir.display())))?;
        let mut out = OutDir {
            dir: dir.to_path_buf(),
            lock: dir.join(LOCK_FILE),
            locked: false,
            replacing: false,
            notes: Vec::new(),
        };
        out.take_lock()?;
        // from here on, an error drops `out`, which releases the lock
        let targets: Vec<String> = run_files_in(dir)?;
        let mut targets: Vec<&str> = targets.iter().map(String::as_str).collect();
        targets.extend(RUN_FILES);
        let removed = remove_stale_temporaries(dir, &targets)?;
        if !removed.is_empty() {
            let names: Vec<String> = removed.iter().map(|p| p.display().to_string()).collect();
            out.notes.push(format!(
                "removed {} temporary file(s) left by killed runs: {}",
                removed.len(),
                names.join(", ")
            ));
        }
        out.recover_replaced()?;
        let earlier = out.previous_run_files()?;
        // a run reads and appends to its files: each must be a regular file (a link to
        // /dev/zero would be read without end and written to)
        for name in &earlier {
            let path = dir.join(name);
            if !std::fs::metadata(&path).is_ok_and(|m| m.is_file()) {
                return Err(Error::Io(format!(
                    "{}: not a regular file (a link to a device, a FIFO or a directory?); a run's {name} must be a file: move it away",
                    path.display()
                )));
            }
        }
        if !resume && !overwrite && !earlier.is_empty() {
            let hint = if earlier.iter().any(|f| f == "checkpoint.safetensors") {
                "pass --resume to continue it, --overwrite to replace it, or choose another --out"
            } else {
                "it wrote no checkpoint, so it cannot be resumed: pass --overwrite to replace it, or choose another --out"
            };
            return Err(Error::Invalid(format!(
                "--out {} holds the record of an earlier run ({}); {hint}",
                dir.display(),
                earlier.join(", ")
            )));
        }
        Ok(out)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// With `latest_link` (see [`super::RunOptions::latest_link`]), points `<root>/latest` at
    /// this directory and returns the line that announces it.
    pub fn link_latest(&self, latest_link: Option<&Path>) -> Result<Option<String>> {
        let Some(root) = latest_link else {
            return Ok(None);
        };
        let latest = root.join("latest");
        Ok(Some(match point_latest(root, &self.dir)? {
            None => format!(
                "writing {} ({} points to it)",
                self.dir.display(),
                latest.display()
            ),
            Some(note) => format!("writing {} ({note})", self.dir.display()),
        }))
    }

    /// The names of the run files (see [`is_run_file`]) present in the directory.
    pub fn previous_run_files(&self) -> Result<Vec<String>> {
        run_files_in(&self.dir)
    }

    /// `--overwrite`: sets the earlier run's files aside in [`REPLACED_DIR`] (other files in the
    /// directory are kept). They are deleted by [`OutDir::first_checkpoint_written`] and put
    /// back if this value is dropped before that.
    pub fn set_aside_previous_run(&mut self) -> Result<()> {
        if self.previous_run_files()?.is_empty() {
            return Ok(());
        }
        move_run_files(&self.dir, &self.dir.join(REPLACED_DIR))?;
        self.replacing = true;
        Ok(())
    }

    /// The new run has written its first checkpoint: the earlier run it replaces (if any) is
    /// deleted now.
    pub fn first_checkpoint_written(&mut self) -> Result<()> {
        if self.replacing {
            let replaced = self.dir.join(REPLACED_DIR);
            std::fs::remove_dir_all(&replaced)
                .map_err(|e| Error::Io(format!("{}: {e}", replaced.display())))?;
            self.replacing = false;
        }
        Ok(())
    }

    /// A [`REPLACED_DIR`] left by a killed `--overwrite` run: when that run wrote no
    /// checkpoint, its files are deleted and the earlier run's put back; when it did, the
    /// earlier run's are deleted (as the run would have done).
    fn recover_replaced(&mut self) -> Result<()> {
        let replaced = self.dir.join(REPLACED_DIR);
        if !replaced.is_dir() {
            return Ok(());
        }
        if self.dir.join("checkpoint.safetensors").exists() {
            std::fs::remove_dir_all(&replaced)
                .map_err(|e| Error::Io(format!("{}: {e}", replaced.display())))?;
            return Ok(());
        }
        for name in run_files_in(&self.dir)? {
            let path = self.dir.join(name);
            std::fs::remove_file(&path)
                .map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
        }
        move_run_files(&replaced, &self.dir)?;
        std::fs::remove_dir_all(&replaced)
            .map_err(|e| Error::Io(format!("{}: {e}", replaced.display())))?;
        self.notes.push(format!(
            "a run started with --overwrite in {} ended before its first checkpoint: the run it was replacing has been put back",
            self.dir.display()
        ));
        Ok(())
    }

    /// Creates the lock file holding this process's PID; a lock of a process that is no
    /// longer running is removed first (with a note).
    fn take_lock(&mut self) -> Result<()> {
        let lock = self.lock.clone();
        let io = |e: std::io::Error| Error::Io(format!("{}: {e}", lock.display()));
        // two attempts: the second follows the removal of a stale lock (if another run took
        // it over in between, create_new fails again and its PID is reported below)
        for _ in 0..2 {
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&lock)
            {
                Ok(mut f) => {
                    self.locked = true;
                    writeln!(f, "{}", std::process::id()).map_err(io)?;
                    f.sync_all().map_err(io)?;
                    return Ok(());
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let text = std::fs::read_to_string(&lock).unwrap_or_default();
                    let Ok(pid) = text.trim().parse::<u32>() else {
                        return Err(Error::Io(format!(
                            "{}: a lock file that holds no PID ({:?}): another run may be starting in {}; if none is, delete the lock file",
                            lock.display(),
                            text.trim(),
                            self.dir.display()
                        )));
                    };
                    if process_is_running(pid) {
                        return Err(Error::Io(format!(
                            "--out {} is in use by another moegrad run (PID {pid}, lock {}); wait for it to finish or choose another --out. If no moegrad run is writing there (the lock may be stale and its PID reused by another program), delete {}",
                            self.dir.display(),
                            lock.display(),
                            lock.display()
                        )));
                    }
                    match std::fs::remove_file(&lock) {
                        Ok(()) => self.notes.push(format!(
                            "took over the lock {} of process {pid}, which is no longer running",
                            lock.display()
                        )),
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                        Err(e) => return Err(io(e)),
                    }
                }
                Err(e) => return Err(io(e)),
            }
        }
        Err(Error::Io(format!(
            "{}: could not take the lock (another run is claiming {} at the same time)",
            lock.display(),
            self.dir.display()
        )))
    }
}

impl Drop for OutDir {
    /// Puts back an earlier run set aside by `--overwrite` when this run wrote no checkpoint,
    /// and releases the lock this value took. (No one else removes it meanwhile: a lock is
    /// taken over only when its process is no longer running.)
    fn drop(&mut self) {
        if self.replacing {
            let _ = self.recover_replaced();
        }
        if self.locked {
            let _ = std::fs::remove_file(&self.lock);
        }
    }
}

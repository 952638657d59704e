//! The output directory of a training run (`--out`), claimed before anything is written to it:
//!
//! * a lock file (`.moegrad.lock`, created with `create_new`, holding the PID) keeps two runs
//!   from writing the same directory at once; a lock whose process is no longer running (a run
//!   that was killed) is taken over with a note, a live one is an error naming its PID;
//! * a fresh run refuses a directory that holds an earlier run's files (metrics, checkpoint,
//!   plots) unless told `--resume` (continue it) or `--overwrite` (replace it); with
//!   `--overwrite` the old files are deleted only once the new run is set up, so a typo in the
//!   new command costs nothing;
//! * temporaries that a killed run left while writing a checkpoint atomically are deleted.
//!
//! [`super::run`] holds the [`OutDir`] for the whole run; dropping it releases the lock.

use crate::checkpoint::{process_is_running, remove_stale_temporaries};
use crate::{Error, Result};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The files a run writes to its output directory: its record.
pub const RUN_FILES: &[&str] = &[
    "metrics.jsonl",
    "checkpoint.safetensors",
    "curves.svg",
    "expert_load.svg",
];

/// The lock file's name inside the output directory.
pub const LOCK_FILE: &str = ".moegrad.lock";

/// An output directory claimed by this process; the lock is released when it is dropped.
#[derive(Debug)]
pub struct OutDir {
    dir: PathBuf,
    lock: PathBuf,
    /// whether this value created the lock file (and so removes it when dropped)
    locked: bool,
    /// what claiming the directory did that the user should hear about (a stale lock taken
    /// over, temporaries of killed runs removed)
    pub notes: Vec<String>,
}

impl OutDir {
    /// Creates `dir` if needed, takes its lock, deletes temporaries left by killed runs, and,
    /// for a fresh run (`resume` false), refuses a directory holding an earlier run's files
    /// unless `overwrite` is set.
    ///
    /// # Errors
    /// `resume` and no directory; the directory cannot be created; another live process holds the lock (the message
    /// names its PID); an earlier run's files are present without `resume` or `overwrite`.
    pub fn claim(dir: &Path, resume: bool, overwrite: bool) -> Result<OutDir> {
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
            notes: Vec::new(),
        };
        out.take_lock()?;
        // from here on, an error drops `out`, which releases the lock
        let removed = remove_stale_temporaries(dir, RUN_FILES)?;
        if !removed.is_empty() {
            let names: Vec<String> = removed.iter().map(|p| p.display().to_string()).collect();
            out.notes.push(format!(
                "removed {} temporary file(s) left by killed runs: {}",
                removed.len(),
                names.join(", ")
            ));
        }
        let earlier = out.previous_run_files();
        if !resume && !overwrite && !earlier.is_empty() {
            return Err(Error::Invalid(format!(
                "--out {} holds the record of an earlier run ({}); pass --resume to continue it, --overwrite to replace it, or choose another --out",
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

    /// The names of the [`RUN_FILES`] present in the directory.
    pub fn previous_run_files(&self) -> Vec<&'static str> {
        RUN_FILES
            .iter()
            .copied()
            .filter(|f| self.dir.join(f).exists())
            .collect()
    }

    /// Deletes an earlier run's files (`--overwrite`); other files in the directory are kept.
    pub fn clear_previous_run(&self) -> Result<()> {
        for f in self.previous_run_files() {
            let path = self.dir.join(f);
            std::fs::remove_file(&path)
                .map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
        }
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
                            "--out {} is in use by another moegrad run (PID {pid}, lock {}); wait for it to finish or choose another --out",
                            self.dir.display(),
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
    /// Releases the lock this value took. (No one else removes it meanwhile: a lock is taken
    /// over only when its process is no longer running.)
    fn drop(&mut self) {
        if self.locked {
            let _ = std::fs::remove_file(&self.lock);
        }
    }
}

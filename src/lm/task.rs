//! The language models as a [`Task`] of the one training loop (`train/trainer.rs`): a GPT or a
//! Llama-style decoder ([`LanguageModel`]) trained by iterations on random windows of a tokenized text (`--tokenizer`: characters or
//! subword tokens, `data/token_corpus.rs`), one evaluation interval (`--eval-every`
//! iterations) per period, evaluated on fixed validation windows in nats per token and in bits
//! per character, with the tokenizer stored in each checkpoint, summarised as an
//! [`LmSummary`].

use super::language_model::LanguageModel;
use super::train::{LmSummary, evaluate, make_optimizer, text_path};
use crate::checkpoint::Checkpoint;
use crate::data::{TokenCorpus, TokenizerSpec};
use crate::optim::Optimizer;
use crate::train::TaskModel;
use crate::train::task::{Batch, Evaluation, PeriodResult, RunEnd, Task};
use crate::train::{Period, TrainConfig};
use crate::{Device, Error, Result, Tensor};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

/// A language-model run: its corpus, its model and the fixed validation windows.
pub(super) struct LmTask<'a> {
    cfg: &'a TrainConfig,
    device: Device,
    corpus: TokenCorpus,
    model: LanguageModel,
    /// the tokenizer as each checkpoint's metadata stores it (`vocab` or `tokenizer`)
    tokenizer_meta: BTreeMap<String, String>,
    /// the starts of the fixed validation windows
    val_starts: Vec<usize>,
    /// target tokens of the validation windows per character they stand for: bits per
    /// character = loss per token · this / ln 2 (exactly 1 for `--tokenizer char`)
    tokens_per_char: f64,
    /// the batch size of evaluation
    eval_batch: usize,
}

impl<'a> LmTask<'a> {
    /// Loads and tokenizes the corpus and builds the model (checking its settings and memory).
    /// `cfg` is already validated as a language-model run.
    pub(super) fn new(cfg: &'a TrainConfig) -> Result<LmTask<'a>> {
        let device = Device::from_name(&cfg.device)?;
        if cfg.optimizer == crate::train::OptimizerKind::Sgd {
            return Err(Error::Invalid(
                "the language models train with --optimizer adamw (the default) or adam".into(),
            ));
        }
        let corpus = match &cfg.init_from {
            // the checkpoint's own tokenizer, whatever --tokenizer says (see lm/init_from.rs)
            Some(path) => {
                let (_, tokenizer) = super::init_from::checkpoint_settings(path)?;
                let tokenizer = tokenizer.ok_or_else(|| {
                    Error::Invalid(format!(
                        "--init-from {}: the checkpoint has no tokenizer, so it cannot be trained on text",
                        path.display()
                    ))
                })?;
                let source = text_path(cfg)?;
                let text = crate::data::text::load_text(&source)?;
                TokenCorpus::with_tokenizer(&text, tokenizer, cfg.block, &source)?
            }
            None => {
                let spec = TokenizerSpec::parse(&cfg.tokenizer)?;
                TokenCorpus::load(&text_path(cfg)?, &spec, cfg.block)?
            }
        };
        let model = LanguageModel::build_initialised(cfg, corpus.vocab_size(), device)?;
        let mut tokenizer_meta = BTreeMap::new();
        corpus.tokenizer.annotate(&mut tokenizer_meta)?;
        let val_starts = corpus.val_windows(cfg.eval_windows, cfg.block, cfg.seed);
        let targets = (val_starts.len() * cfg.block) as f64;
        let tokens_per_char = targets / corpus.chars_in_windows(&val_starts, cfg.block) as f64;
        Ok(LmTask {
            cfg,
            device,
            corpus,
            model,
            tokenizer_meta,
            val_starts,
            tokens_per_char,
            eval_batch: cfg.batch.max(32),
        })
    }

    /// The mean validation loss on the fixed windows.
    fn validation_loss(&self) -> Result<f64> {
        evaluate(
            &self.model,
            &self.corpus,
            &self.val_starts,
            self.cfg.block,
            self.eval_batch,
            self.device,
        )
    }

    /// Bits per character of a validation loss in nats per token.
    fn bits_per_char(&self, loss: f64) -> f64 {
        loss * self.tokens_per_char / std::f64::consts::LN_2
    }

    /// A resumed character model's text must have the checkpoint's vocabulary (its
    /// embedding and output layer are sized by it): says so, with both sizes and the new
    /// symbols, when it changed.
    fn check_vocab(&self, ckpt: &Path, saved: &str, now: &str) -> Result<()> {
        if saved == now {
            return Ok(());
        }
        let added: String = now.chars().filter(|c| !saved.contains(*c)).collect();
        let removed: String = saved.chars().filter(|c| !now.contains(*c)).collect();
        Err(Error::Invalid(format!(
            "--resume: the data's vocabulary changed since {} was written ({} → {} symbols{}{}): a character model cannot continue on other characters; train a new run on this text",
            ckpt.display(),
            saved.chars().count(),
            now.chars().count(),
            if added.is_empty() {
                String::new()
            } else {
                format!(", new: {added:?}")
            },
            if removed.is_empty() {
                String::new()
            } else {
                format!(", gone: {removed:?}")
            }
        )))
    }
}

impl Task for LmTask<'_> {
    type Summary = LmSummary;
    const PERIOD: Period = Period::Interval;

    fn model(&self) -> &dyn TaskModel {
        &self.model
    }
    fn optimizer(&self) -> Result<Box<dyn Optimizer>> {
        Ok(Box::new(make_optimizer(self.cfg, &self.model)?))
    }
    fn tasks(&self) -> usize {
        0
    }
    fn periods(&self) -> usize {
        self.cfg.iters / self.cfg.eval_every
    }
    fn steps_per_period(&self) -> u64 {
        self.cfg.eval_every as u64
    }
    fn title(&self) -> String {
        format!("{} on {}", self.cfg.model.name(), self.cfg.data.name())
    }

    /// A resumed run must read the same tokens as the checkpoint's: the same characters
    /// (`char`), or the same tokenizer (a BPE trained on a changed text differs; so may a
    /// `tokenizer.json` rewritten in place). A changed `--tokenizer` setting is left to the
    /// settings check (`resume::check_config`), which lists it with the others.
    fn check_resume(&self, ckpt: &Path) -> Result<()> {
        let Ok(meta) = Checkpoint::read_metadata(ckpt) else {
            return Ok(()); // no checkpoint: resume::restore says so
        };
        let saved_setting = meta
            .get("config")
            .and_then(|c| serde_json::from_str::<TrainConfig>(c).ok())
            .map(|c| c.tokenizer);
        if saved_setting.is_some_and(|t| t != self.cfg.tokenizer) {
            return Ok(());
        }
        for (key, now) in &self.tokenizer_meta {
            let Some(saved) = meta.get(key) else {
                continue;
            };
            if key == crate::data::VOCAB_KEY {
                self.check_vocab(ckpt, saved, now)?;
            } else if saved != now {
                return Err(Error::Invalid(format!(
                    "--resume: --tokenizer {} gives another tokenizer than the one {} was trained with ({} → {} tokens{}): a model cannot continue on other tokens; train a new run",
                    self.cfg.tokenizer,
                    ckpt.display(),
                    crate::data::Tokenizer::from_json(saved, "the checkpoint's tokenizer")
                        .map_or("?".into(), |t| t.vocab_size().to_string()),
                    self.corpus.vocab_size(),
                    if self.cfg.tokenizer.starts_with("bpe:") {
                        ", trained on a text that changed"
                    } else {
                        ", the file changed"
                    }
                )));
            }
        }
        Ok(())
    }

    fn start_period(&mut self, _period: usize) {}

    /// `--batch` random windows of `--block` characters, fixed by the seed and the step.
    fn batch(&self, _i: usize, step: u64) -> Result<Batch> {
        let (b, t) = (self.cfg.batch, self.cfg.block);
        let (x, y) = self.corpus.train_batch(b, t, self.cfg.seed, step);
        Ok(Batch {
            x: Tensor::from_i32(x, &[b, t], self.device)?,
            y: vec![Tensor::from_i32(y, &[b * t], self.device)?],
            weight: 1,
        })
    }
    fn mean_train_loss(&self, loss_sum: f64) -> f64 {
        loss_sum / self.cfg.eval_every as f64
    }
    fn step_message(&self, loss: f64, _i: usize, _started: Instant) -> String {
        format!("loss {loss:.4}")
    }
    fn evaluate(&self) -> Result<Evaluation> {
        Ok(Evaluation {
            loss: self.validation_loss()?,
            accuracy: Vec::new(),
        })
    }
    fn annotate(&self, ck: &mut Checkpoint) {
        ck.metadata.extend(self.tokenizer_meta.clone());
    }
    fn after_checkpoint(&self) {
        // The evaluation's batches (its last one of another size) and the checkpoint's host
        // copies left blocks in the CPU buffer pool that the training step does not ask for:
        // hand them back, so that the process's memory does not grow with each evaluation.
        crate::backend::cpu::buffer_pool::trim();
    }
    fn metrics_line(
        &self,
        r: &PeriodResult,
        _number: usize,
        step: u64,
        lr: f64,
    ) -> serde_json::Value {
        serde_json::json!({
            "iter": step, "lr": lr, "train_loss": r.train_loss,
            "val_loss": r.eval.loss, "val_ppl": r.eval.loss.exp(),
            "val_bpc": self.bits_per_char(r.eval.loss),
            "interval_seconds": r.started.elapsed().as_secs_f64(),
        })
    }
    fn report_line(&self, r: &PeriodResult, _number: usize, step: u64) -> String {
        format!(
            "iter {step}: train loss {:.4}, val loss {:.4} (ppl {:.2}, {:.4} bits/char), {:.1} s",
            r.train_loss,
            r.eval.loss,
            r.eval.loss.exp(),
            self.bits_per_char(r.eval.loss),
            r.started.elapsed().as_secs_f64()
        )
    }

    /// When the run had no interval left to train, the validation loss is measured here.
    fn summary(&mut self, run: RunEnd, trained_any: bool, last: PeriodResult) -> Result<LmSummary> {
        let val_loss = if trained_any {
            last.eval.loss
        } else {
            self.validation_loss()?
        };
        let ms_per_iter = if run.trained_steps > 0 {
            1e3 * run.train_seconds / run.trained_steps as f64
        } else {
            f64::NAN
        };
        let tokens_per_iter = (self.cfg.batch * self.cfg.block) as f64;
        Ok(LmSummary {
            device: self.device.to_string(),
            iters: run.steps,
            seconds: run.seconds,
            train_loss: last.train_loss,
            val_loss,
            val_ppl: val_loss.exp(),
            val_bpc: self.bits_per_char(val_loss),
            ms_per_iter,
            tokens_per_s: tokens_per_iter / (ms_per_iter / 1e3),
            params: run.params,
            // at the experts per token measured over the last interval where there is one
            // (threshold routing, DSelect-k and capacity drops make it differ from k)
            active_params_per_token: last
                .experts_per_token
                .map_or(self.model.active_params_per_token(), |e| {
                    self.model.active_params_at(e)
                }),
            expert_load: last.routing.as_ref().map(|r| r.0.clone()),
            routing: last.diagnostics.clone(),
            drop_rate: last.routing.map(|r| r.1),
            experts_per_token: last.experts_per_token,
            vocab: self.corpus.vocab_size(),
            profile: run.profile.as_ref().map(crate::profile::Report::rows),
            gpu_profile: run.profile.and_then(|p| p.gpu),
        })
    }
}

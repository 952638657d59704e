//! The language models' tokenizers (`data/tokenizer.rs`, `data/token_corpus.rs`): a byte-level
//! BPE trained on the training split (its size, exact round trips, determinism, speed on the
//! bundled Shakespeare), the character tokenizer's ids unchanged, a `tokenizer.json` file, the
//! checkpoint metadata round trip, the characters each token stands for, and `--tokenizer`
//! values refused with the value named.

use moegrad::data::text::{CharCorpus, SHAKESPEARE_FILE};
use moegrad::data::{TokenCorpus, Tokenizer, TokenizerSpec, pieces};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn shakespeare() -> PathBuf {
    moegrad::data::bundled::dir().join(SHAKESPEARE_FILE)
}

fn tmp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("moegrad-tok-{}-{name}", std::process::id()))
}

#[test]
fn bpe_on_shakespeare_is_small_exact_deterministic_and_fast() {
    let started = std::time::Instant::now();
    let c = TokenCorpus::load(&shakespeare(), &TokenizerSpec::Bpe(512), 64).unwrap();
    let seconds = started.elapsed().as_secs_f64();
    eprintln!(
        "bpe:512 on Shakespeare: trained and encoded in {seconds:.2} s; {} + {} tokens",
        c.train.len(),
        c.val.len()
    );
    assert!(seconds < 60.0, "BPE training took {seconds} s");
    let v = c.vocab_size();
    assert!(v <= 512 && v > 400, "vocabulary {v}");
    assert!(c.train.iter().chain(&c.val).all(|&i| (i as usize) < v));
    // the validation text is the last 10% of the characters, and round-trips exactly
    let text = moegrad::data::text::load_text(&shakespeare()).unwrap();
    let n = text.chars().count();
    let val_text: String = text.chars().skip(n * 9 / 10).collect();
    assert_eq!(c.tokenizer.decode(&c.val).unwrap(), val_text);
    let train_text: String = text.chars().take(n * 9 / 10).collect();
    assert_eq!(c.tokenizer.decode(&c.train).unwrap(), train_text);
    drop(train_text);
    // each validation token's characters sum to the validation text's
    assert_eq!(c.val_chars.len(), c.val.len());
    assert_eq!(
        c.val_chars.iter().map(|&x| x as u64).sum::<u64>(),
        val_text.chars().count() as u64
    );
    // several characters per token: BPE merged something
    let per_token = val_text.chars().count() as f64 / c.val.len() as f64;
    assert!(per_token > 1.7, "{per_token} characters per token");
    // the BPE's training alone, on the training split
    let train_text: String = text.chars().take(n * 9 / 10).collect();
    let started = std::time::Instant::now();
    Tokenizer::train_bpe(&train_text, 512).unwrap();
    eprintln!(
        "bpe:512 trained on the training split in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    // the same text and size give the same tokenizer
    let again = TokenCorpus::load(&shakespeare(), &TokenizerSpec::Bpe(512), 64).unwrap();
    assert_eq!(
        again.tokenizer.to_json().unwrap(),
        c.tokenizer.to_json().unwrap()
    );
    assert_eq!(again.train, c.train);
}

#[test]
fn bpe_round_trips_any_text_and_counts_characters() {
    let train = "the cat sat on the mat; the rat sat on the hat.\n".repeat(40);
    let tok = Tokenizer::train_bpe(&train, 300).unwrap();
    assert!(tok.vocab_size() <= 300 && tok.vocab_size() > 256);
    // characters never seen in training (multi-byte ones) are bytes: exact round trip
    let odd = "Ünïcødé → ★ 日本語\n  spaced   out\t\ttabs\n\nthe cat";
    let (ids, chars) = tok.encode_counting_chars(odd).unwrap();
    assert_eq!(tok.decode(&ids).unwrap(), odd);
    assert_eq!(
        chars.iter().map(|&c| c as usize).sum::<usize>(),
        odd.chars().count()
    );
    // a merged token stands for several characters, a byte of a 3-byte character for 1 or 0
    let (ids, chars) = tok.encode_counting_chars("the cat").unwrap();
    assert!(ids.len() < 7, "{ids:?}");
    assert_eq!(chars.iter().sum::<u32>(), 7);
    let (ids, chars) = tok.encode_counting_chars("★").unwrap();
    assert_eq!(ids.len(), 3);
    assert_eq!(chars, vec![1, 0, 0]);
    // streaming gives the text whole characters at a time
    let (ids, _) = tok.encode_counting_chars(odd).unwrap();
    let mut stream = tok.stream();
    let streamed: String = ids.iter().map(|&i| stream.step(i).unwrap()).collect();
    assert_eq!(streamed, odd);
}

#[test]
fn pieces_cut_only_before_a_newline_after_a_word_and_encode_as_the_whole() {
    let text = "alpha beta\n\n  gamma\ndelta \nepsilon\nzeta";
    let parts: Vec<&str> = pieces(text, 1).collect();
    assert_eq!(parts.concat(), text);
    for p in &parts[1..] {
        assert!(p.starts_with('\n'), "{p:?}");
    }
    assert_eq!(
        parts,
        vec!["alpha beta", "\n\n  gamma", "\ndelta \nepsilon", "\nzeta"]
    );
    // the pieces' ids are the whole text's (encode in one piece vs in many)
    let train = "alpha beta gamma delta epsilon zeta\n".repeat(30);
    let tok = Tokenizer::train_bpe(&train, 280).unwrap();
    let long = "alpha beta\n\n  gamma\ndelta \nepsilon\nzeta ".repeat(5000);
    let whole = tok.encode(&long).unwrap();
    let json = tok.to_json().unwrap().unwrap();
    let hf: tokenizers::Tokenizer = json.parse().unwrap();
    let direct: Vec<i32> = hf
        .encode(long.as_str(), false)
        .unwrap()
        .get_ids()
        .iter()
        .map(|&i| i as i32)
        .collect();
    assert_eq!(whole, direct);
}

#[test]
fn the_char_tokenizer_keeps_todays_ids() {
    let path = shakespeare();
    let chars = CharCorpus::load(&path, 64).unwrap();
    let tokens = TokenCorpus::load(&path, &TokenizerSpec::Char, 64).unwrap();
    assert_eq!(tokens.tokenizer.char_vocab().unwrap(), &chars.vocab[..]);
    assert_eq!(tokens.train, chars.train);
    assert_eq!(tokens.val, chars.val);
    assert!(tokens.val_chars.iter().all(|&c| c == 1));
    assert_eq!(
        tokens.train_batch(4, 64, 3, 9),
        chars.train_batch(4, 64, 3, 9)
    );
    assert_eq!(tokens.val_windows(10, 64, 3), chars.val_windows(10, 64, 3));
    let s = "ROMEO: what light";
    assert_eq!(
        tokens.tokenizer.encode(s).unwrap(),
        chars.encode(s).unwrap()
    );
    // a char model's bits per character are its nats per character / ln 2: one per token
    let starts = tokens.val_windows(7, 64, 1);
    assert_eq!(tokens.chars_in_windows(&starts, 64), 7 * 64);
}

#[test]
fn a_tokenizer_json_file_loads_and_metadata_round_trips() {
    let train = "to be or not to be, that is the question\n".repeat(50);
    let tok = Tokenizer::train_bpe(&train, 270).unwrap();
    let path = tmp("tokenizer.json");
    std::fs::write(&path, tok.to_json().unwrap().unwrap()).unwrap();
    let spec = TokenizerSpec::parse(path.to_str().unwrap()).unwrap();
    assert_eq!(spec, TokenizerSpec::File(path.clone()));
    let loaded = Tokenizer::build(&spec, "").unwrap();
    assert_eq!(loaded.vocab_size(), tok.vocab_size());
    assert_eq!(
        loaded.encode("that is the question").unwrap(),
        tok.encode("that is the question").unwrap()
    );
    // a corpus with it: the file's tokens, not trained ones
    let text = "that is the question; to be or not to be.\n".repeat(30);
    let c = TokenCorpus::from_text(&text, &spec, 8, Path::new("t.txt")).unwrap();
    assert_eq!(c.vocab_size(), tok.vocab_size());
    // in a checkpoint's metadata: the JSON under `tokenizer`
    let mut meta = BTreeMap::new();
    loaded.annotate(&mut meta).unwrap();
    assert!(meta.contains_key("tokenizer") && !meta.contains_key("vocab"));
    let back = Tokenizer::from_metadata(&meta, Path::new("c.safetensors")).unwrap();
    assert_eq!(back.to_json().unwrap(), loaded.to_json().unwrap());
    // a character tokenizer under `vocab`, as before
    let mut meta = BTreeMap::new();
    Tokenizer::chars(vec!['a', 'b'])
        .annotate(&mut meta)
        .unwrap();
    assert_eq!(meta.get("vocab").map(String::as_str), Some("ab"));
    let back = Tokenizer::from_metadata(&meta, Path::new("c")).unwrap();
    assert_eq!(back.char_vocab().unwrap(), &['a', 'b']);
    // files that are not tokenizers
    let missing = tmp("missing.json");
    let err = Tokenizer::build(&TokenizerSpec::File(missing.clone()), "")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(missing.to_str().unwrap()) && err.contains("cannot read"),
        "{err}"
    );
    let bad = tmp("bad.json");
    std::fs::write(&bad, "{\"model\": 3}").unwrap();
    let err = Tokenizer::from_file(&bad).unwrap_err().to_string();
    assert!(
        err.contains(bad.to_str().unwrap()) && err.contains("not a Hugging Face"),
        "{err}"
    );
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(&bad);
}

#[test]
fn bad_tokenizer_values_are_refused_with_the_value() {
    for (value, word) in [
        ("bpe:100", "between 257"),
        ("bpe:256", "between 257"),
        ("bpe:1000000", "65536"),
        ("bpe:x", "not a whole number"),
        ("bpe:", "not a whole number"),
        ("words", "expected char, bpe:N"),
        ("tokenizer.txt", "expected char, bpe:N"),
    ] {
        let err = TokenizerSpec::parse(value).unwrap_err().to_string();
        assert!(err.contains(value) && err.contains(word), "{value}: {err}");
    }
    assert_eq!(
        TokenizerSpec::parse("bpe:257").unwrap(),
        TokenizerSpec::Bpe(257)
    );
    assert_eq!(TokenizerSpec::parse("char").unwrap(), TokenizerSpec::Char);
    // a text too short for the block in tokens
    let err = TokenCorpus::from_text(
        &"abc def\n".repeat(40),
        &TokenizerSpec::Bpe(300),
        200,
        Path::new("short.txt"),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("short.txt") && err.contains("--block 200"),
        "{err}"
    );
}

#[test]
fn bits_per_character_count_the_characters_of_the_target_tokens() {
    let c = TokenCorpus {
        tokenizer: Tokenizer::chars(vec!['a']),
        train: vec![0; 8],
        val: vec![0; 5],
        val_chars: vec![1, 2, 3, 4, 5],
        source: PathBuf::from("t"),
    };
    // a window at s predicts ids s+1 ..= s+block: the characters of those
    assert_eq!(c.chars_in_windows(&[0], 2), 2 + 3);
    assert_eq!(c.chars_in_windows(&[2], 2), 4 + 5);
    assert_eq!(c.chars_in_windows(&[0, 1, 2], 2), 5 + 7 + 9);
}

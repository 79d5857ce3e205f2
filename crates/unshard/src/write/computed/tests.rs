//! Computed tensors written a block at a time give the whole-tensor values.
#![allow(clippy::unwrap_used)]

use crate::cancel::Cancel;
use crate::dtype;
use crate::dtype::fuse::{self as math, Factors, Layout};
use crate::dtype::DType;
use crate::options::MergeOptions;
use crate::plan::{Candidate, Expr, Origin, Plan, PlannedTensor, ShardPlan};
use crate::prepare::{prepare, Inputs};
use crate::source::test_input::MemInput;
use crate::write::direct::OutFile;
use crate::write::engine::write_blocks;
use crate::write::{NoProgress, ShardFile, WINDOW_BYTES};

/// Writes `plan` with blocks of `block` bytes; the shards' bytes.
fn write(plan: &Plan, inputs: Inputs<'_>, block: u64) -> Vec<Vec<u8>> {
    let dir = tempfile::tempdir().unwrap();
    let files: Vec<Box<dyn ShardFile>> = plan
        .shards
        .iter()
        .map(|s| {
            let f = OutFile::create(&dir.path().join(&s.file_name), s.file_size).unwrap();
            Box::new(f) as Box<dyn ShardFile>
        })
        .collect();
    write_blocks(
        plan,
        inputs,
        &files,
        block,
        true,
        &NoProgress,
        &Cancel::new(),
    )
    .unwrap();
    drop(files);
    let read = |s: &ShardPlan| std::fs::read(dir.path().join(&s.file_name)).unwrap();
    plan.shards.iter().map(read).collect()
}

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

/// Fused weights far larger than a block, of odd widths (rows cut by block
/// edges), in every layout, with and without DoRA: the bytes written a block at
/// a time are the whole-tensor fuse (`math::fuse`) converted once.
#[test]
fn fused_rows_cut_by_blocks_equal_the_whole_tensor_fuse() {
    let (rows, cols, r) = (301usize, 77usize, 5usize);
    let mut input = MemInput::default();
    let mut leaf = |name: &str, values: &[f32], shape: &[u64]| {
        Expr::leaf(Origin::Checkpoint, input.tensor(name, values, shape))
    };
    let w = random(rows * cols, 1);
    let mut tensors = Vec::new();
    let mut want = Vec::new();
    for (i, layout) in [Layout::Linear, Layout::FanInFanOut, Layout::Embedding]
        .into_iter()
        .enumerate()
    {
        for dora in [false, true] {
            let seed = 10 * i as u64 + dora as u64;
            let (sa, sb) = layout.factor_shapes(rows as u64, cols as u64, r as u64);
            let a = random(r * (sa[1] as usize), seed + 2);
            let b = random(r * (sb[0] as usize), seed + 3);
            let channels = layout.out_channels(rows as u64, cols as u64) as usize;
            let m = dora.then(|| random(channels, seed + 4));
            let name = format!("w{i}{dora}");
            let expr = Expr::Fuse {
                base: Box::new(leaf("w", &w, &[rows as u64, cols as u64])),
                a: Box::new(leaf("a", &a, &sa)),
                b: Box::new(leaf("b", &b, &sb)),
                magnitude: m
                    .as_ref()
                    .map(|m| Box::new(leaf("m", m, &[channels as u64]))),
                scale: 0.37,
                layout,
            };
            let mut whole = w.clone();
            math::fuse(
                &mut whole,
                rows,
                cols,
                &Factors {
                    layout,
                    a: &a,
                    b: &b,
                    rank: r,
                    scale: 0.37,
                    magnitude: m.as_deref(),
                },
            );
            let src: Vec<u8> = whole.iter().flat_map(|v| v.to_le_bytes()).collect();
            let mut bf16 = vec![0u8; rows * cols * 2];
            dtype::convert(&src, DType::F32, &mut bf16, DType::BF16);
            want.extend(bf16);
            let c = Candidate::computed(&name, "w", Origin::Checkpoint, expr).unwrap();
            tensors.push(PlannedTensor {
                dtype: DType::BF16,
                ..PlannedTensor::from_candidate(c)
            });
        }
    }
    // Laid out back to back after a header that puts the first row off a block edge.
    let header = vec![b' '; 1000];
    let each = (rows * cols * 2) as u64;
    let entries = (0..tensors.len())
        .map(|i| (i, 1000 + i as u64 * each))
        .collect();
    let file_size = 1000 + tensors.len() as u64 * each;
    let plan = Plan {
        tensors,
        shards: vec![ShardPlan {
            file_name: "x.safetensors".into(),
            header: header.clone(),
            entries,
            file_size,
        }],
        dtype: None,
        config: None,
        index: None,
        total_size: file_size - 1000,
        report: Default::default(),
    };
    let ckpt = input.checkpoint();
    let inputs = Inputs {
        checkpoint: &ckpt,
        base: None,
        extra: &[],
    };
    let mut expected = header;
    expected.extend(want);
    for block in [4096, 3 * 4096, WINDOW_BYTES] {
        let got = write(&plan, inputs, block);
        assert!(
            got[0] == expected,
            "{block}-byte blocks: first difference at byte {:?}",
            got[0].iter().zip(&expected).position(|(a, b)| a != b)
        );
    }
}

/// Every LoRA fixture case merged with 4 KiB blocks (tensors cut across many
/// blocks, evaluated by many workers in any order) gives the bytes of 8 MiB
/// blocks (each tensor whole in one block).
#[test]
fn lora_fixtures_give_the_same_bytes_whatever_the_blocks() {
    let fixtures = crate::fixtures();
    let text = std::fs::read_to_string(fixtures.join("lora/cases.json")).unwrap();
    let cases: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut checked = 0;
    for case in cases["cases"].as_array().unwrap() {
        let args: Vec<&str> = case["extra_args"]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_str()).collect())
            .unwrap_or_default();
        let arg = |f: &str| args.iter().position(|a| *a == f).map(|i| args[i + 1]);
        let mut opts = MergeOptions {
            checkpoint: fixtures.join(case["adapter"].as_str().unwrap()),
            base: Some(fixtures.join(case["base"].as_str().unwrap())),
            ..MergeOptions::default()
        };
        opts.adapter.name = arg("--adapter").map(str::to_string);
        opts.adapter.config = arg("--adapter-config").map(|p| fixtures.join(p));
        let p = prepare(&opts).unwrap();
        let fused = p
            .plan
            .tensors
            .iter()
            .filter(|t| matches!(&t.content, crate::plan::Content::Computed(_)))
            .count();
        assert!(fused > 0, "{}", case["name"]);
        assert_eq!(
            write(&p.plan, p.inputs(), 4096),
            write(&p.plan, p.inputs(), WINDOW_BYTES),
            "{}",
            case["name"]
        );
        checked += 1;
    }
    assert!(checked >= 8, "only {checked} cases");
}

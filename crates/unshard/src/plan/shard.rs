//! Step 5 of planning: shard files. Tensors (in transformers' natural name order)
//! are split into files as huggingface_hub does: a new file when the next tensor
//! would pass the size limit, a tensor larger than the limit in a file of its own.
//! Each file's header is serialized as the safetensors reference writer does (keys
//! sorted by dtype, descending, then by name; the JSON padded with spaces to a
//! multiple of 8 bytes), and the index as transformers writes it (sorted keys,
//! indent 2, a trailing newline).

use std::collections::HashSet;

use super::{BaseView, PlannedTensor, ShardPlan};

/// Splits tensors into shards as huggingface_hub's `split_torch_state_dict_into_shards`
/// does (a new file when the next tensor would pass `max`, a tensor larger than
/// `max` alone in a file, emitted when met), then lays out each file: header in safetensors' canonical order (dtype descending, then
/// name), data in that order.
pub fn shard(tensors: &[PlannedTensor], max: u64) -> (Vec<ShardPlan>, u64) {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut cur: Vec<usize> = Vec::new();
    let mut cur_size = 0u64;
    let mut total = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        let size = t.nbytes();
        total += size;
        if size > max {
            groups.push(vec![i]);
            continue;
        }
        if cur_size + size > max {
            groups.push(std::mem::take(&mut cur));
            cur_size = 0;
        }
        cur.push(i);
        cur_size += size;
    }
    if !cur.is_empty() {
        groups.push(cur);
    }
    let n = groups.len();
    let shards = groups
        .into_iter()
        .enumerate()
        .map(|(k, mut idx)| {
            idx.sort_by(|&a, &b| {
                tensors[b]
                    .dtype
                    .cmp(&tensors[a].dtype)
                    .then_with(|| tensors[a].name.cmp(&tensors[b].name))
            });
            let file_name = if n == 1 {
                "model.safetensors".to_string()
            } else {
                format!("model-{:05}-of-{:05}.safetensors", k + 1, n)
            };
            layout(file_name, tensors, idx)
        })
        .collect();
    (shards, total)
}

/// Serializes a safetensors header exactly as the reference writer does.
fn layout(file_name: String, tensors: &[PlannedTensor], order: Vec<usize>) -> ShardPlan {
    let mut json = String::from("{\"__metadata__\":{\"format\":\"pt\"}");
    let mut offset = 0u64;
    let mut rel = Vec::with_capacity(order.len());
    for &i in &order {
        let t = &tensors[i];
        let end = offset + t.nbytes();
        let shape: Vec<String> = t.shape.iter().map(u64::to_string).collect();
        json.push_str(&format!(
            ",{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{offset},{end}]}}",
            serde_json::to_string(&t.name).unwrap_or_default(),
            t.dtype.safetensors_name(),
            shape.join(",")
        ));
        rel.push((i, offset));
        offset = end;
    }
    json.push('}');
    while json.len() % 8 != 0 {
        json.push(' ');
    }
    let mut header = (json.len() as u64).to_le_bytes().to_vec();
    header.extend_from_slice(json.as_bytes());
    let data_start = header.len() as u64;
    ShardPlan {
        file_name,
        entries: rel.into_iter().map(|(i, o)| (i, data_start + o)).collect(),
        file_size: data_start + offset,
        header,
    }
}

/// `model.safetensors.index.json` as transformers writes it (sorted keys, indent 2).
pub(crate) fn index_json(
    tensors: &[PlannedTensor],
    shards: &[ShardPlan],
    total_size: u64,
    params: u64,
) -> String {
    let mut weight_map = std::collections::BTreeMap::new();
    for s in shards {
        for (i, _) in &s.entries {
            weight_map.insert(tensors[*i].name.clone(), s.file_name.clone());
        }
    }
    let index = serde_json::json!({
        "metadata": {"total_parameters": params, "total_size": total_size},
        "weight_map": weight_map,
    });
    let mut s = serde_json::to_string_pretty(&index).unwrap_or_default();
    s.push('\n');
    s
}

/// `metadata.total_parameters` of the index: the base's own figure when the output
/// holds exactly the base's tensor set, else the sum of the tensors' elements.
pub(crate) fn total_parameters(
    tensors: &[PlannedTensor],
    base: BaseView<'_>,
    base_names: Option<&HashSet<&str>>,
) -> u64 {
    let same_set = base.weights.is_some_and(|w| {
        w.tensors.len() == tensors.len()
            && tensors
                .iter()
                .all(|t| base_names.is_some_and(|b| b.contains(t.name.as_str())))
    });
    match base.total_parameters {
        Some(p) if same_set => p,
        _ => tensors.iter().map(|t| t.numel()).sum(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::plan::testing::tensor;
    use crate::plan::{Candidate, Origin};

    fn planned(name: &str, dtype: DType, n: u64) -> PlannedTensor {
        PlannedTensor::from_candidate(Candidate::copy(
            Origin::Checkpoint,
            &tensor(name, dtype, &[n]),
        ))
    }

    #[test]
    fn shards_split_before_the_limit_and_a_large_tensor_stands_alone() {
        // 40, 40, 200 (over the 100-byte limit), 40, 40, 40 bytes.
        let t = vec![
            planned("a", DType::F32, 10),
            planned("b", DType::F32, 10),
            planned("big", DType::F32, 50),
            planned("c", DType::F32, 10),
            planned("d", DType::F32, 10),
            planned("e", DType::F32, 10),
        ];
        let (shards, total) = shard(&t, 100);
        assert_eq!(total, 400);
        let names: Vec<&str> = shards.iter().map(|s| s.file_name.as_str()).collect();
        assert_eq!(
            names,
            [
                "model-00001-of-00004.safetensors",
                "model-00002-of-00004.safetensors",
                "model-00003-of-00004.safetensors",
                "model-00004-of-00004.safetensors"
            ]
        );
        let members: Vec<Vec<usize>> = shards
            .iter()
            .map(|s| s.entries.iter().map(|e| e.0).collect())
            .collect();
        // The big tensor is emitted alone, before the file being filled is closed.
        assert_eq!(members, [vec![2], vec![0, 1], vec![3, 4], vec![5]]);
    }

    #[test]
    fn a_header_is_sorted_by_dtype_then_name_and_padded_to_8_bytes() {
        let t = vec![
            planned("z", DType::BF16, 2),
            planned("a", DType::BF16, 1),
            planned("w", DType::F32, 1),
        ];
        let (shards, _) = shard(&t, 1 << 30);
        let s = &shards[0];
        assert_eq!(s.file_name, "model.safetensors");
        let n = u64::from_le_bytes(s.header[..8].try_into().unwrap()) as usize;
        assert_eq!(n % 8, 0);
        assert_eq!(s.header.len(), 8 + n);
        let json = std::str::from_utf8(&s.header[8..]).unwrap();
        assert_eq!(
            json.trim_end(),
            r#"{"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"BF16","shape":[1],"data_offsets":[4,6]},"z":{"dtype":"BF16","shape":[2],"data_offsets":[6,10]}}"#
        );
        let at = s.header.len() as u64;
        assert_eq!(s.entries, [(2, at), (1, at + 4), (0, at + 6)]);
        assert_eq!(s.file_size, at + 10);
    }

    #[test]
    fn the_index_maps_every_tensor_to_its_file() {
        let t = vec![planned("a", DType::F32, 10), planned("b", DType::F32, 10)];
        let (shards, total) = shard(&t, 40);
        let ix = index_json(&t, &shards, total, 20);
        let v: serde_json::Value = serde_json::from_str(&ix).unwrap();
        assert_eq!(v["metadata"]["total_size"], 80);
        assert_eq!(v["metadata"]["total_parameters"], 20);
        assert_eq!(v["weight_map"]["b"], "model-00002-of-00002.safetensors");
        assert!(ix.ends_with("}\n") && ix.contains("\n  \"metadata\""));
    }
}

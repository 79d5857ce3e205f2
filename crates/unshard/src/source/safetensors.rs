//! Reading `.safetensors` files (base model weights, or a checkpoint to inspect).
//!
//! A file is an 8-byte little-endian header length `n`, `n` bytes of JSON, then the
//! tensor data. Only the header is read (8 + `n` bytes). It is validated as strictly
//! as the reference reader does (docs/formats.md): bounded size, valid JSON, known
//! dtypes, offsets contiguous from 0 with no gap, no overlap and no trailing bytes,
//! and every extent computed with checked arithmetic. A violation names the file and
//! the tensor.

use std::path::Path;

use super::{contiguous_strides, Blob, FileId, Piece, StorageId, TensorSource};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// The reference reader's cap on the header size.
pub const MAX_HEADER: u64 = 100_000_000;

/// Whether a file of `file_len` bytes starting with `head` plausibly is a
/// safetensors file.
pub fn looks_like_safetensors(head: &[u8], file_len: u64) -> bool {
    if head.len() < 10 {
        return false;
    }
    let mut n = [0u8; 8];
    n.copy_from_slice(&head[..8]);
    let n = u64::from_le_bytes(n);
    (2..=MAX_HEADER).contains(&n) && 8 + n <= file_len && head[8] == b'{'
}

/// One parsed header.
#[derive(Debug)]
pub struct Header {
    /// Byte offset of the data buffer in the file (8 + header length).
    pub data_start: u64,
    /// `(name, dtype, shape, begin, end)` in header order, offsets relative to `data_start`.
    pub tensors: Vec<(String, DType, Vec<u64>, u64, u64)>,
    /// `__metadata__` entries, in header order.
    pub metadata: Vec<(String, String)>,
}

/// Parses and validates the header of a safetensors file held whole in `data`.
#[cfg_attr(not(feature = "internals"), allow(dead_code))] // for the tests and fuzz targets
pub fn read_header(path: &Path, data: &[u8]) -> Result<Header> {
    parse_header(path, data, data.len() as u64)
}

/// Reads and validates the header of a safetensors file, reading only the header.
pub fn read_header_from(blob: &Blob) -> Result<Header> {
    parse_header(&blob.path, &header_bytes(blob)?, blob.len())
}

/// The first 8 + `n` bytes of a safetensors file: the length and the JSON header.
/// A length over [`MAX_HEADER`] or past the end of the file gives what fits, so that
/// [`parse_header`] reports it.
pub fn header_bytes(blob: &Blob) -> Result<Vec<u8>> {
    let len = blob.len();
    if len < 8 {
        return blob.head(8);
    }
    let mut n = [0u8; 8];
    blob.read_at(0, &mut n)?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER || 8 + n > len {
        return Ok(n.to_le_bytes().to_vec());
    }
    blob.read_vec(0, 8 + n)
}

/// Parses and validates a safetensors header from `prefix`, the first bytes of a
/// file of `len` bytes (at least the length and the JSON header).
pub fn parse_header(path: &Path, prefix: &[u8], len: u64) -> Result<Header> {
    let data = prefix;
    if len < 8 || data.len() < 8 {
        return Err(Error::corrupt(path, "too short for a safetensors header"));
    }
    let mut n = [0u8; 8];
    n.copy_from_slice(&data[..8]);
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER {
        return Err(Error::corrupt(
            path,
            format!("safetensors header of {n} bytes exceeds the {MAX_HEADER}-byte limit"),
        ));
    }
    if 8 + n > len || 8 + n > data.len() as u64 {
        return Err(Error::corrupt(
            path,
            format!(
                "safetensors header claims {n} bytes but the file has {len}; the file is truncated"
            ),
        ));
    }
    let text = std::str::from_utf8(&data[8..(8 + n) as usize])
        .map_err(|_| Error::corrupt(path, "the safetensors header is not UTF-8"))?;
    let (tensors, metadata) = json::parse(path, text)?;
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by_key(|&i| (tensors[i].3, tensors[i].4));
    let mut expect = 0u64;
    for &i in &order {
        let (name, dtype, shape, begin, end) = &tensors[i];
        let bad = |msg: String| Error::bad_tensor(path, name, msg);
        if *begin != expect {
            return Err(bad(format!(
                "data starts at {begin} but the previous tensor ends at {expect} (gap or overlap)"
            )));
        }
        let nbytes = shape
            .iter()
            .try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
        if end.checked_sub(*begin) != Some(nbytes) {
            return Err(bad(format!(
                "data_offsets [{begin}, {end}] do not match {nbytes} bytes of {dtype} {shape:?}"
            )));
        }
        expect = *end;
    }
    if 8 + n + expect != len {
        return Err(Error::corrupt(
            path,
            format!("tensor data ends at byte {} but the file has {len} bytes; the file is truncated or has trailing bytes", 8 + n + expect),
        ));
    }
    Ok(Header {
        data_start: 8 + n,
        tensors,
        metadata,
    })
}

/// The header's JSON read straight into its entries, without building a JSON value
/// tree first: a header of tens of thousands of tensors (a MoE model's per-expert
/// weights) parses in a few milliseconds and a few allocations per tensor.
mod json {
    use std::fmt;
    use std::path::Path;

    use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, Visitor};

    use crate::dtype::DType;
    use crate::error::{Error, Result};

    type Entry = (String, DType, Vec<u64>, u64, u64);
    type Parsed = (Vec<Entry>, Vec<(String, String)>);

    /// What made the header unacceptable, with the tensor it concerns.
    enum Fault {
        File(String),
        Tensor(String, String),
    }

    /// The entries in header order and the `__metadata__` pairs.
    pub(super) fn parse(path: &Path, text: &str) -> Result<Parsed> {
        let mut fault = None;
        let mut de = serde_json::Deserializer::from_str(text);
        let parsed = Top { fault: &mut fault }
            .deserialize(&mut de)
            .and_then(|v| de.end().map(|()| v));
        match (parsed, fault) {
            (_, Some(Fault::Tensor(name, msg))) => Err(Error::bad_tensor(path, name, msg)),
            (_, Some(Fault::File(msg))) => Err(Error::corrupt(path, msg)),
            (Err(e), None) => Err(Error::corrupt(
                path,
                format!("the safetensors header is not a JSON object: {e}"),
            )),
            (Ok(v), None) => Ok(v),
        }
    }

    fn fail<E: de::Error>(fault: &mut Option<Fault>, f: Fault) -> E {
        let msg = match &f {
            Fault::File(m) | Fault::Tensor(_, m) => m.clone(),
        };
        fault.get_or_insert(f);
        E::custom(msg)
    }

    struct Top<'f> {
        fault: &'f mut Option<Fault>,
    }

    impl<'de> DeserializeSeed<'de> for Top<'_> {
        type Value = Parsed;
        fn deserialize<D: de::Deserializer<'de>>(
            self,
            d: D,
        ) -> std::result::Result<Self::Value, D::Error> {
            d.deserialize_map(self)
        }
    }

    impl<'de> Visitor<'de> for Top<'_> {
        type Value = Parsed;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(
            self,
            mut map: A,
        ) -> std::result::Result<Self::Value, A::Error> {
            let mut tensors: Vec<Entry> = Vec::new();
            let mut metadata = Vec::new();
            // A name given twice keeps its first place and its last entry, as a JSON
            // map does (verify names such a file; readers keep the last entry).
            let mut seen = std::collections::HashMap::new();
            while let Some(name) = map.next_key::<String>()? {
                if name == "__metadata__" {
                    metadata = map.next_value_seed(Meta { fault: self.fault })?;
                    continue;
                }
                let entry = map.next_value_seed(Tensor {
                    name: &name,
                    fault: self.fault,
                });
                let (dtype, shape, begin, end) = match entry {
                    Ok(e) => e,
                    Err(e) if self.fault.is_some() => return Err(e),
                    Err(e) => {
                        let msg =
                            format!("is not an object with dtype, shape and data_offsets ({e})");
                        return Err(fail(self.fault, Fault::Tensor(name, msg)));
                    }
                };
                match seen.get(&name) {
                    Some(&i) => tensors[i] = (name, dtype, shape, begin, end),
                    None => {
                        seen.insert(name.clone(), tensors.len());
                        tensors.push((name, dtype, shape, begin, end));
                    }
                }
            }
            Ok((tensors, metadata))
        }
    }

    struct Meta<'f> {
        fault: &'f mut Option<Fault>,
    }

    impl<'de> DeserializeSeed<'de> for Meta<'_> {
        type Value = Vec<(String, String)>;
        fn deserialize<D: de::Deserializer<'de>>(
            self,
            d: D,
        ) -> std::result::Result<Self::Value, D::Error> {
            d.deserialize_any(self)
        }
    }

    impl<'de> Visitor<'de> for Meta<'_> {
        type Value = Vec<(String, String)>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("an object of strings")
        }
        fn visit_map<A: MapAccess<'de>>(
            self,
            mut map: A,
        ) -> std::result::Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some(k) = map.next_key::<String>()? {
                match map.next_value::<serde_json::Value>()? {
                    serde_json::Value::String(v) => out.push((k, v)),
                    _ => {
                        let msg = format!("__metadata__ value '{k}' is not a string");
                        return Err(fail(self.fault, Fault::File(msg)));
                    }
                }
            }
            Ok(out)
        }
        fn visit_seq<A: de::SeqAccess<'de>>(
            self,
            _: A,
        ) -> std::result::Result<Self::Value, A::Error> {
            Err(self.not_object())
        }
        fn visit_str<E: de::Error>(self, _: &str) -> std::result::Result<Self::Value, E> {
            Err(self.not_object())
        }
        fn visit_bool<E: de::Error>(self, _: bool) -> std::result::Result<Self::Value, E> {
            Err(self.not_object())
        }
        fn visit_unit<E: de::Error>(self) -> std::result::Result<Self::Value, E> {
            Err(self.not_object())
        }
    }

    impl Meta<'_> {
        fn not_object<E: de::Error>(self) -> E {
            fail(
                self.fault,
                Fault::File("__metadata__ is not an object".into()),
            )
        }
    }

    struct Tensor<'a, 'f> {
        name: &'a str,
        fault: &'f mut Option<Fault>,
    }

    impl<'de> DeserializeSeed<'de> for Tensor<'_, '_> {
        type Value = (DType, Vec<u64>, u64, u64);
        fn deserialize<D: de::Deserializer<'de>>(
            self,
            d: D,
        ) -> std::result::Result<Self::Value, D::Error> {
            d.deserialize_map(self)
        }
    }

    impl<'de> Visitor<'de> for Tensor<'_, '_> {
        type Value = (DType, Vec<u64>, u64, u64);
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("an object with dtype, shape and data_offsets")
        }
        fn visit_map<A: MapAccess<'de>>(
            self,
            mut map: A,
        ) -> std::result::Result<Self::Value, A::Error> {
            let name = self.name;
            let fault = self.fault;
            let mut bad =
                |msg: &str| fail::<A::Error>(fault, Fault::Tensor(name.into(), msg.into()));
            let (mut dtype, mut shape, mut offsets) = (None, None, None);
            while let Some(k) = map.next_key::<String>()? {
                match k.as_str() {
                    "dtype" => {
                        let s = map
                            .next_value::<String>()
                            .map_err(|_| bad("dtype is not a string"))?;
                        let d = DType::from_safetensors_name(&s)
                            .ok_or_else(|| bad(&format!("unsupported dtype {s}")))?;
                        dtype = Some(d);
                    }
                    "shape" => {
                        let v = map.next_value::<Vec<u64>>();
                        shape =
                            Some(v.map_err(|_| bad("shape is not a list of non-negative ints"))?);
                    }
                    "data_offsets" => {
                        let v = map.next_value::<Vec<u64>>();
                        offsets = Some(v.map_err(|_| bad("data_offsets is not [begin, end]"))?);
                    }
                    _ => {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
            }
            let dtype = dtype.ok_or_else(|| bad("no dtype"))?;
            let shape = shape.ok_or_else(|| bad("shape is not a list of non-negative ints"))?;
            match offsets.as_deref() {
                Some(&[begin, end]) => Ok((dtype, shape, begin, end)),
                _ => Err(bad("data_offsets is not [begin, end]")),
            }
        }
    }
}

/// Describes every tensor of a safetensors file as a one-piece source, taking the
/// parsed header's entries (`data_start` and `tensors` of [`Header`]) by value.
pub fn sources(
    file: FileId,
    data_start: u64,
    tensors: Vec<(String, DType, Vec<u64>, u64, u64)>,
) -> Vec<TensorSource> {
    tensors
        .into_iter()
        .map(|(name, dtype, shape, begin, _)| TensorSource {
            pieces: vec![Piece {
                file,
                byte_offset: data_start + begin,
                dtype,
                strides: contiguous_strides(&shape),
                global_offset: vec![0; shape.len()],
                shape: shape.clone(),
                big_endian: false,
            }]
            .into(),
            storage: Some(StorageId {
                file,
                key: name.clone(),
            }),
            name,
            dtype,
            shape,
            layout: None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A safetensors file: the length, `header` padded to `pad` bytes with spaces
    /// (as the reference writer pads), then `data` bytes.
    fn file(header: &str, pad: usize, data: usize) -> Vec<u8> {
        let mut h = header.as_bytes().to_vec();
        h.resize(h.len().max(pad), b' ');
        let mut v = (h.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(&h);
        v.extend((0..data).map(|i| i as u8));
        v
    }

    fn err(bytes: &[u8], len: u64) -> String {
        parse_header(Path::new("x.safetensors"), bytes, len)
            .unwrap_err()
            .to_string()
    }

    const TWO: &str = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"BF16","shape":[1,3],"data_offsets":[8,14]},"__metadata__":{"format":"pt"}}"#;

    #[test]
    fn a_good_header_gives_offsets_relative_to_the_data() {
        let f = file(TWO, 160, 14);
        let h = read_header(Path::new("x"), &f).unwrap();
        assert_eq!(h.data_start, 8 + 160);
        assert_eq!(
            h.tensors,
            [
                ("a".to_string(), DType::F32, vec![2], 0, 8),
                ("b".to_string(), DType::BF16, vec![1, 3], 8, 14),
            ]
        );
        assert_eq!(h.metadata, [("format".to_string(), "pt".to_string())]);
        // Read through a blob: only the header is fetched, the same result.
        let blob = Blob::owned("x".into(), f.clone());
        assert_eq!(header_bytes(&blob).unwrap(), f[..168]);
        assert_eq!(read_header_from(&blob).unwrap().tensors, h.tensors);
        let s = sources(3, h.data_start, h.tensors);
        let at: Vec<(&str, usize, u64)> = s
            .iter()
            .map(|t| (t.name.as_str(), t.pieces[0].file, t.pieces[0].byte_offset))
            .collect();
        assert_eq!(at, [("a", 3, 168), ("b", 3, 176)]);
    }

    #[test]
    fn sniffing_needs_a_plausible_length_and_a_brace() {
        let f = file("{}", 2, 0);
        assert_eq!(f.len(), 10);
        assert!(looks_like_safetensors(&f, 10));
        assert!(!looks_like_safetensors(&f[..9], 10), "9 bytes are too few");
        assert!(
            !looks_like_safetensors(&f, 9),
            "the header runs past the end"
        );
        let mut one = f.clone();
        one[0] = 1;
        assert!(!looks_like_safetensors(&one, 10), "a 1-byte header");
        let mut brace = f.clone();
        brace[8] = b'[';
        assert!(!looks_like_safetensors(&brace, 10));
        let mut max = (MAX_HEADER).to_le_bytes().to_vec();
        max.extend_from_slice(b"{}");
        assert!(looks_like_safetensors(&max, 8 + MAX_HEADER));
        let mut over = (MAX_HEADER + 1).to_le_bytes().to_vec();
        over.extend_from_slice(b"{}");
        assert!(!looks_like_safetensors(&over, 9 + MAX_HEADER));
    }

    #[test]
    fn header_lengths_over_the_cap_or_the_file_are_refused_by_name() {
        let e = err(&(MAX_HEADER + 1).to_le_bytes(), 1 << 40);
        assert!(e.contains("exceeds the 100000000-byte limit"), "{e}");
        // At the cap the length itself is fine; this file is just too short.
        let e = err(&MAX_HEADER.to_le_bytes(), 1000);
        assert!(e.contains("truncated"), "{e}");
        let f = file(TWO, 160, 14);
        let e = err(&f[..100], f.len() as u64);
        assert!(e.contains("claims 160 bytes"), "{e}");
        let e = err(&f, 167);
        assert!(e.contains("claims 160 bytes but the file has 167"), "{e}");
        assert!(err(&f[..7], 7).contains("too short"));
        assert!(err(&f[..7], 100).contains("too short"));

        // header_bytes gives only the length when the header cannot be read whole.
        let blob = Blob::owned("x".into(), f[..100].to_vec());
        assert_eq!(header_bytes(&blob).unwrap(), f[..8]);
        let blob = Blob::owned("x".into(), f[..168].to_vec());
        assert_eq!(header_bytes(&blob).unwrap(), f[..168]);
        let mut big = (MAX_HEADER + 1).to_le_bytes().to_vec();
        big.extend(std::iter::repeat_n(b' ', 64));
        let blob = Blob::owned("x".into(), big.clone());
        assert_eq!(header_bytes(&blob).unwrap(), big[..8]);
        let blob = Blob::owned("x".into(), vec![1, 2, 3]);
        assert_eq!(header_bytes(&blob).unwrap(), [1, 2, 3]);
    }

    #[test]
    fn data_must_tile_the_buffer_exactly() {
        let f = file(TWO, 160, 14);
        let e = err(&f[..f.len() - 1], f.len() as u64 - 1);
        assert!(e.contains("ends at byte 182 but the file has 181"), "{e}");
        let mut longer = f.clone();
        longer.push(0);
        let e = err(&longer, longer.len() as u64);
        assert!(e.contains("trailing bytes"), "{e}");

        let gap = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"BF16","shape":[1,3],"data_offsets":[10,16]}}"#;
        let g = file(gap, 160, 16);
        assert!(err(&g, g.len() as u64).contains("gap or overlap"));
        let late = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
        let l = file(late, 96, 12);
        let e = err(&l, l.len() as u64);
        assert!(
            e.contains("starts at 4 but the previous tensor ends at 0"),
            "{e}"
        );
        let short = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,7]}}"#;
        let s = file(short, 96, 7);
        let e = err(&s, s.len() as u64);
        assert!(e.contains("do not match 8 bytes"), "{e}");
        let huge = r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}}"#;
        let h = file(huge, 96, 8);
        assert!(err(&h, h.len() as u64).contains("overflows"));
    }

    #[test]
    fn malformed_entries_name_what_is_wrong() {
        for (json, says) in [
            (r#"{"a":{"shape":[1],"data_offsets":[0,4]}}"#, "no dtype"),
            (
                r#"{"a":{"dtype":"X9","shape":[1],"data_offsets":[0,4]}}"#,
                "unsupported dtype X9",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#,
                "shape is not",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}}"#,
                "data_offsets",
            ),
            (r#"{"__metadata__":{"k":1}}"#, "'k' is not a string"),
            (r#"{"__metadata__":[]}"#, "__metadata__ is not an object"),
            ("[]", "not a JSON object"),
            (
                r#"{"a":{"dtype":7,"shape":[1],"data_offsets":[0,4]}}"#,
                "dtype is not a string",
            ),
            (r#"{"a":[]}"#, "is not an object with dtype"),
        ] {
            let f = file(json, 0, 4);
            let e = err(&f, f.len() as u64);
            assert!(e.contains(says), "{json}: {e}");
        }
    }

    /// A file of `len` bytes whose first 8 say `n`, the rest zeros; reads are served
    /// without storing the file (a header length near the cap costs no disk).
    #[derive(Debug)]
    struct Sparse(u64, u64);

    impl crate::source::ByteSource for Sparse {
        fn name(&self) -> &Path {
            Path::new("sparse.safetensors")
        }
        fn len(&self) -> u64 {
            self.0
        }
        fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
            buf.fill(0);
            let n = self.1.to_le_bytes();
            for (i, b) in buf.iter_mut().enumerate().take(8) {
                if let Some(&v) = n.get((offset + i as u64) as usize) {
                    *b = v;
                }
            }
            Ok(())
        }
    }

    #[test]
    fn only_a_header_within_the_cap_is_read() {
        let blob = |len, n| Blob::new(std::sync::Arc::new(Sparse(len, n)));
        // Over the cap: the length alone, however long the file.
        assert_eq!(
            header_bytes(&blob(1 << 40, MAX_HEADER + 1)).unwrap().len(),
            8
        );
        // At the cap, in a file that holds it: the whole header.
        let at_cap = header_bytes(&blob(8 + MAX_HEADER, MAX_HEADER)).unwrap();
        assert_eq!(at_cap.len() as u64, 8 + MAX_HEADER);
        // An 8-byte file of an empty header, and a file of a header and no data.
        assert_eq!(header_bytes(&blob(8, 0)).unwrap(), [0u8; 8]);
        let empty = file("{}", 2, 0);
        let h = read_header(Path::new("x"), &empty).unwrap();
        assert_eq!((h.data_start, h.tensors.len()), (10, 0));
        // The file's length is checked, not only the bytes given.
        let e = err(&empty, 7);
        assert!(e.contains("too short"), "{e}");
        let e = err(&[0u8; 8], 8);
        assert!(e.contains("not a JSON object"), "{e}");
    }
}

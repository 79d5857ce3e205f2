//! The names the audit knows: what torch, DeepSpeed and the checkpoint formats
//! unshard reads legitimately put in a pickle ([`allowed`]), and what is known to run
//! code, read or write files, open connections or load further pickles
//! ([`dangerous`]). Everything in neither list is "unknown": it still runs on
//! `torch.load`, so it is reported, only without the stronger word.
//!
//! The allowlist follows what the writers produce (torch's `_rebuild_*` functions,
//! storage classes, dtypes, DTensor/ShardedTensor/DCP metadata classes, DeepSpeed's
//! loss scalers and enums, numpy scalars), checked against every fixture in the
//! repository. The dangerous list covers picklescan's list of dangerous globals and
//! the callables payloads are known to use (`marshal.loads`, `types.FunctionType`,
//! nested `torch.load` / `numpy.load`, `copyreg.add_extension`).

/// A module's entries: every name in it, or these names (a name also matches its
/// nested attributes: `Outer` matches `Outer.method`).
enum Names {
    All,
    Only(&'static [&'static str]),
}

use Names::{All, Only};

/// Whether `name` is `entry` or an attribute of it.
fn name_matches(name: &str, entry: &str) -> bool {
    name == entry
        || name
            .strip_prefix(entry)
            .is_some_and(|rest| rest.starts_with('.'))
}

/// Whether the table lists `module.name`: exactly for the allowlist (an attribute of
/// an allowed class is not allowed: `torch.Tensor.__reduce_ex__` is not data), or
/// with its attributes for the dangerous list.
fn lookup(table: &[(&str, Names)], module: &str, name: &str, exact: bool) -> bool {
    table.iter().any(|(m, names)| {
        *m == module
            && match names {
                All => !exact || !name.contains('.'),
                Only(list) => list.iter().any(|e| {
                    if exact {
                        name == *e
                    } else {
                        name_matches(name, e)
                    }
                }),
            }
    })
}

const BUILTIN_DATA: &[&str] = &[
    "set",
    "frozenset",
    "bytearray",
    "bytes",
    "list",
    "dict",
    "tuple",
    "int",
    "float",
    "complex",
    "str",
    "bool",
    "slice",
    "range",
    "object",
];

const TORCH_DTYPES: &[&str] = &[
    "float32",
    "float",
    "float64",
    "double",
    "float16",
    "half",
    "bfloat16",
    "complex32",
    "chalf",
    "complex64",
    "cfloat",
    "complex128",
    "cdouble",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "int8",
    "int16",
    "short",
    "int32",
    "int",
    "int64",
    "long",
    "bool",
    "quint8",
    "qint8",
    "qint32",
    "quint4x2",
    "quint2x4",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "bits8",
    "bits16",
    "bits1x8",
    "bits2x4",
    "bits4x2",
    "int1",
    "int2",
    "int3",
    "int4",
    "int5",
    "int6",
    "int7",
    "uint1",
    "uint2",
    "uint3",
    "uint4",
    "uint5",
    "uint6",
    "uint7",
];

/// Names in module `torch` that are data: `Size`, `device`, `Tensor`, layouts, memory
/// formats and quantization schemes.
const TORCH_DATA: &[&str] = &[
    "Size",
    "device",
    "Tensor",
    "strided",
    "sparse_coo",
    "sparse_csr",
    "sparse_csc",
    "sparse_bsr",
    "sparse_bsc",
    "_mkldnn",
    "jagged",
    "contiguous_format",
    "channels_last",
    "channels_last_3d",
    "preserve_format",
    "per_tensor_affine",
    "per_channel_affine",
    "per_tensor_symmetric",
    "per_channel_symmetric",
    "per_channel_affine_float_qparams",
    "UntypedStorage",
    "TypedStorage",
];

const ALLOWED: &[(&str, Names)] = &[
    (
        "collections",
        Only(&["OrderedDict", "defaultdict", "Counter"]),
    ),
    ("builtins", Only(BUILTIN_DATA)),
    ("__builtin__", Only(BUILTIN_DATA)),
    ("_codecs", Only(&["encode"])),
    (
        "copyreg",
        Only(&["_reconstructor", "__newobj__", "__newobj_ex__"]),
    ),
    (
        "copy_reg",
        Only(&["_reconstructor", "__newobj__", "__newobj_ex__"]),
    ),
    ("torch", Only(TORCH_DTYPES)),
    ("torch", Only(TORCH_DATA)),
    (
        "torch._tensor",
        Only(&["_rebuild_from_type_v2", "_rebuild_from_type"]),
    ),
    (
        "torch.nn.parameter",
        Only(&["Parameter", "Buffer", "UninitializedParameter"]),
    ),
    ("torch.storage", Only(&["UntypedStorage", "TypedStorage"])),
    ("torch.serialization", Only(&["_get_layout"])),
    // DTensor (both module layouts torch has used) and its spec and mesh.
    ("torch.distributed.tensor", Only(&["DTensor"])),
    ("torch.distributed.tensor._api", Only(&["DTensor"])),
    ("torch.distributed._tensor", Only(&["DTensor"])),
    ("torch.distributed._tensor.api", Only(&["DTensor"])),
    (
        "torch.distributed.tensor._dtensor_spec",
        Only(&["DTensorSpec", "TensorMeta", "ShardOrderEntry"]),
    ),
    ("torch.distributed._tensor.placement_types", All),
    ("torch.distributed.tensor.placement_types", All),
    ("torch.distributed.device_mesh", Only(&["DeviceMesh"])),
    (
        "torch.distributed._mesh_layout",
        Only(&["_MeshLayout", "_FlatLayout"]),
    ),
    // ShardedTensor. Protocol 2 names a nested class as
    // getattr(ShardedTensor, 'ProcessGroupState').
    (
        "torch.distributed._shard.sharded_tensor.api",
        Only(&["ShardedTensor", "ShardedTensor.ProcessGroupState"]),
    ),
    (
        "torch.distributed._shard.sharded_tensor.metadata",
        Only(&[
            "ShardedTensorMetadata",
            "TensorProperties",
            "MEM_FORMAT_ENCODING",
        ]),
    ),
    (
        "torch.distributed._shard.sharded_tensor.shard",
        Only(&["Shard"]),
    ),
    (
        "torch.distributed._shard.metadata",
        Only(&["ShardMetadata"]),
    ),
    (
        "torch.distributed._shard.sharding_spec.chunk_sharding_spec",
        Only(&["ChunkShardingSpec"]),
    ),
    (
        "torch.distributed._shard.sharding_spec.api",
        Only(&["EnumerableShardingSpec"]),
    ),
    ("torch.distributed.remote_device", Only(&["_remote_device"])),
    // torch.distributed.checkpoint metadata.
    ("torch.distributed.checkpoint.metadata", All),
    (
        "torch.distributed.checkpoint.filesystem",
        Only(&["_StorageInfo"]),
    ),
    (
        "torch.distributed.checkpoint.planner",
        // Plain dataclasses: torch keeps every rank's save plan in `.metadata`.
        Only(&[
            "WriteItemType",
            "LoadItemType",
            "SavePlan",
            "WriteItem",
            "TensorWriteData",
        ]),
    ),
    // Megatron-Core 0.15's `.metadata`: dataclass subclasses of the two above.
    (
        "megatron.core.dist_checkpointing.strategies.torch",
        Only(&["MCoreMetadata", "MCoreSavePlan"]),
    ),
    (
        "torch.distributed.checkpoint._extension",
        Only(&["ZStandard", "StreamTransformExtension"]),
    ),
    (
        "pathlib",
        Only(&[
            "Path",
            "PosixPath",
            "WindowsPath",
            "PurePath",
            "PurePosixPath",
            "PureWindowsPath",
        ]),
    ),
    // DeepSpeed checkpoints.
    ("deepspeed.runtime.zero.config", Only(&["ZeroStageEnum"])),
    (
        "deepspeed.runtime.fp16.loss_scaler",
        Only(&["LossScaler", "DynamicLossScaler"]),
    ),
    (
        "deepspeed.utils.tensor_fragment",
        Only(&["fragment_address"]),
    ),
    // numpy values torch writes (scalars in optimizer and trainer states).
    ("numpy", Only(&["dtype", "ndarray"])),
    ("numpy.core.multiarray", Only(&["scalar", "_reconstruct"])),
    ("numpy._core.multiarray", Only(&["scalar", "_reconstruct"])),
    ("numpy.dtypes", All),
    (
        "numpy.random._pickle",
        Only(&[
            "__randomstate_ctor",
            "__bit_generator_ctor",
            "__generator_ctor",
        ]),
    ),
    ("argparse", Only(&["Namespace"])),
    (
        "datetime",
        Only(&["datetime", "date", "time", "timedelta", "timezone"]),
    ),
];

/// Whether `module.name` is something torch, DeepSpeed or the formats unshard reads
/// legitimately put in a checkpoint.
pub fn allowed(module: &str, name: &str) -> bool {
    if module == "torch" && name.ends_with("Storage") && !name.contains('.') {
        // `torch.FloatStorage`, `torch.BFloat16Storage`, ... (legacy typed storages).
        return true;
    }
    if module == "torch._utils" && name.starts_with("_rebuild_") && !name.contains('.') {
        // torch's tensor rebuild functions: what every torch.save pickle calls.
        return true;
    }
    lookup(ALLOWED, module, name, true)
}

const BUILTIN_DANGEROUS: &[&str] = &[
    "eval",
    "exec",
    "compile",
    "getattr",
    "setattr",
    "delattr",
    "apply",
    "open",
    "breakpoint",
    "__import__",
    "input",
    "globals",
    "locals",
    "vars",
    "execfile",
    "file",
    "reload",
];

const OPERATOR: &[&str] = &["attrgetter", "itemgetter", "methodcaller"];

const DANGEROUS: &[(&str, Names)] = &[
    ("builtins", Only(BUILTIN_DANGEROUS)),
    ("__builtin__", Only(BUILTIN_DANGEROUS)),
    ("os", All),
    ("posix", All),
    ("nt", All),
    ("subprocess", All),
    ("commands", All),
    ("sys", All),
    ("socket", All),
    ("ssl", All),
    ("shutil", All),
    ("pty", All),
    ("runpy", All),
    ("pickle", All),
    ("_pickle", All),
    ("marshal", All),
    ("dill", All),
    ("shelve", All),
    ("cloudpickle", All),
    ("joblib", All),
    ("ctypes", All),
    ("importlib", All),
    ("asyncio", All),
    ("aiohttp", All),
    ("bdb", All),
    ("pdb", All),
    ("httplib", All),
    ("http", All),
    ("urllib", All),
    ("requests", All),
    ("webbrowser", All),
    ("timeit", All),
    ("profile", All),
    ("cProfile", All),
    ("pydoc", All),
    ("code", All),
    ("codeop", All),
    ("venv", All),
    ("pip", All),
    ("ensurepip", All),
    ("uuid", All),
    ("distutils", All),
    ("test", All),
    ("multiprocessing", All),
    ("signal", All),
    ("_osx_support", All),
    ("_aix_support", All),
    ("_pyrepl", All),
    ("numpy.f2py", All),
    ("numpy.testing", All),
    ("functools", Only(&["partial", "partialmethod", "reduce"])),
    ("operator", Only(OPERATOR)),
    ("_operator", Only(OPERATOR)),
    (
        "types",
        Only(&[
            "CodeType",
            "FunctionType",
            "LambdaType",
            "MethodType",
            "ModuleType",
        ]),
    ),
    ("logging", Only(&["FileHandler"])),
    ("_io", Only(&["FileIO", "open"])),
    ("io", Only(&["FileIO", "open"])),
    ("copyreg", Only(&["add_extension"])),
    ("copy_reg", Only(&["add_extension"])),
    ("doctest", Only(&["debug_script"])),
    ("imaplib", Only(&["IMAP4_stream"])),
    ("pkgutil", Only(&["resolve_name"])),
    ("idlelib", All),
    ("lib2to3", All),
    ("trace", Only(&["Trace"])),
    ("torch", Only(&["load", "hub", "jit", "ops", "classes"])),
    ("torch.serialization", Only(&["load", "_load"])),
    // `torch.load(io.BytesIO(b))`: a nested pickle, run with weights_only=False.
    ("torch.storage", Only(&["_load_from_bytes"])),
    ("torch.hub", All),
    ("torch.jit", Only(&["load", "_load_for_lite_interpreter"])),
    ("torch.jit.unsupported_tensor_ops", All),
    ("torch._dynamo.guards", All),
    ("torch._inductor.codecache", All),
    ("torch.fx.experimental.symbolic_shapes", All),
    ("torch.utils._config_module", All),
    ("torch.utils.bottleneck", All),
    ("torch.utils.collect_env", All),
    ("torch.utils.data.datapipes.utils.decoder", All),
    ("torch.utils.cpp_extension", All),
    ("numpy", Only(&["load", "loadtxt", "fromfile"])),
    ("numpy.lib.npyio", Only(&["load"])),
    ("numpy.ctypeslib", All),
    ("pandas", Only(&["read_pickle"])),
    ("pandas.io.pickle", All),
];

/// Whether `module.name` is known to run code, touch files or the network, or load
/// another pickle. A dangerous module's submodules are dangerous (`os.path`), and so
/// is a dangerous name reached through another module's attribute (`torch.os.system`,
/// since `torch` imports `os`).
pub fn dangerous(module: &str, name: &str) -> bool {
    if module.contains("unknown") || name.contains("unknown") {
        // What picklescan reports for a global it could not resolve.
        return true;
    }
    let full_len = module.len() + 1 + name.len();
    let segments: Vec<&str> = module.split('.').chain(name.split('.')).collect();
    if segments.len() > 32 || full_len > 2048 {
        // Nothing legitimate is that long; do not spend quadratic work on it.
        return true;
    }
    // Every split of every suffix of the dotted path into (module, name).
    for start in 0..segments.len() {
        for split in start + 1..=segments.len() {
            let m = segments[start..split].join(".");
            let rest = segments[split..].join(".");
            let hit = DANGEROUS.iter().any(|(dm, names)| {
                let module_hit = m == *dm || m.starts_with(&format!("{dm}."));
                module_hit
                    && match names {
                        All => true,
                        Only(list) => {
                            !rest.is_empty() && list.iter().any(|e| name_matches(&rest, e))
                        }
                    }
            });
            if hit {
                return true;
            }
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torch_names_are_allowed_and_payloads_are_not() {
        assert!(allowed("torch._utils", "_rebuild_tensor_v2"));
        assert!(allowed("torch", "BFloat16Storage"));
        assert!(allowed("torch", "float8_e4m3fn"));
        assert!(allowed("collections", "OrderedDict"));
        assert!(allowed(
            "torch.distributed.checkpoint.metadata",
            "ChunkStorageMetadata"
        ));
        assert!(!allowed("torch", "load"));
        assert!(!allowed("torch._utils", "_rebuild_tensor_v2.__globals__"));
        assert!(!allowed("builtins", "eval"));
        assert!(!allowed("posix", "system"));
        assert!(!allowed("collections", "OrderedDict2"));
        assert!(!allowed("torch", "Tensor.__reduce_ex__"));
        assert!(!allowed(
            "torch.distributed.checkpoint.metadata",
            "Metadata.x"
        ));
    }

    #[test]
    fn dangerous_names_are_found_through_modules_and_attributes() {
        assert!(dangerous("posix", "system"));
        assert!(dangerous("os.path", "join"));
        assert!(dangerous("builtins", "eval"));
        assert!(dangerous("torch", "os.system"));
        assert!(dangerous("functools", "partial"));
        assert!(dangerous("_operator", "attrgetter"));
        assert!(dangerous("code", "InteractiveInterpreter.runcode"));
        assert!(dangerous("torch.serialization", "load"));
        assert!(!dangerous("builtins", "set"));
        assert!(!dangerous("mymodule", "MyClass"));
        assert!(!dangerous("functools", "lru_cache"));
        assert!(!dangerous("torch", "Size"));
    }

    #[test]
    fn what_picklescan_could_not_resolve_is_dangerous() {
        // picklescan's scanner: "unknown" in the module or in the name is Dangerous.
        assert!(dangerous("unknown", "Thing"));
        assert!(dangerous("mymodule", "unknown"));
    }

    #[test]
    fn names_past_the_length_bounds_are_dangerous() {
        // 32 dotted segments and 2048 bytes of `module.name` pass; one more does not.
        let dotted = |n: usize| vec!["a"; n].join(".");
        assert!(!dangerous("m", &dotted(31)));
        assert!(dangerous("m", &dotted(32)));
        assert!(!dangerous("m", &"n".repeat(2046)));
        assert!(dangerous("m", &"n".repeat(2047)));
        assert!(!dangerous(&"m".repeat(100), &"n".repeat(100)));
    }
}

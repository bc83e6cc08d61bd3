//! Command-line definitions. The names and flags here are the interface scripts rely on.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// saver: save, inspect, verify, load, reshard and export checkpoints of large recommendation
/// models (sparse embedding tables plus dense tensors) as sharded safetensors.
#[derive(Parser, Debug)]
#[command(name = "saver", version, propagate_version = true)]
pub(crate) struct Cli {
    /// The command.
    #[command(subcommand)]
    pub command: Command,
}

/// Output options shared by every command.
#[derive(Args, Debug, Clone, Copy)]
pub(crate) struct Output {
    /// Print one JSON object on stdout instead of text (no progress bars).
    #[arg(long)]
    pub json: bool,
}

/// The commands.
#[derive(Subcommand, Debug)]
pub(crate) enum Command {
    /// Save a checkpoint of a synthetic model or of an existing model (plain safetensors or a
    /// saver checkpoint of any shard count).
    #[command(after_help = "Examples:
  saver save --out /ckpt/step100 --synthetic small --shards 8 --parallel 16
  saver save --out /ckpt/x --synthetic 'tables=8,rows=1000000,dim=64,slots=embedding+adagrad,dense=64MiB,seed=7'
  saver save --out /ckpt/serve --from /dumps/emb --exclude-slots 'adagrad*' --keep-rows 'freq>=5'
  # one process per shard (e.g. under a launcher), all with the same arguments but --shard-index,
  # and a save id that is new for every save and every retry:
  saver save --out /shared/ckpt --synthetic criteo-kaggle,scale=0.1 --shards 4 --shard-index 2 --save-id run7-step1200-a1")]
    Save(Box<SaveArgs>),
    /// Show what a checkpoint holds: tables, slots, rows, dense tensors, shards, files, sizes.
    #[command(after_help = "Example:\n  saver inspect /ckpt/step100 --json")]
    Inspect(InspectArgs),
    /// Check a checkpoint completely: structure and the CRC32 of every tensor. Exit status: 0
    /// intact, 3 incomplete (never committed), 4 corrupt, 1 other errors.
    #[command(
        after_help = "Example:\n  saver verify /ckpt/step100 || echo 'do not load this one'"
    )]
    Verify(VerifyArgs),
    /// Restore a checkpoint into memory, for all M target shards or shard J of M, and report
    /// rows, bytes, time, read amplification and (unless --no-digest) the content digest.
    #[command(
        after_help = "Examples:\n  saver load /ckpt/step100\n  saver load /ckpt/step100 --shards 3 --shard-index 1 --json\n  saver load /ckpt/step100 --into arrays"
    )]
    Load(LoadArgs),
    /// Rewrite a checkpoint for another number of shards.
    #[command(
        after_help = "Example:\n  saver reshard /ckpt/step100 --out /ckpt/step100-m3 --shards 3"
    )]
    Reshard(ReshardArgs),
    /// Rewrite a delta checkpoint and its chain of parents as one full checkpoint, with the
    /// same content (same digest).
    #[command(after_help = "Example:\n  saver compact /ckpt/step1300-delta --out /ckpt/step1300")]
    Compact(CompactArgs),
    /// Write a consolidated plain safetensors copy for serving or other tools: `<table>/ids`
    /// (ascending), `<table>/<slot>` rows in the same order, dense tensors by name.
    #[command(
        after_help = "Examples:\n  saver export /ckpt/step100 --out /serving/v7 --exclude-slots 'adagrad*' --dtype f16\n  saver export /ckpt/step100 --out /serving/v7-int4 --exclude-slots 'adagrad*' --quantize int4"
    )]
    Export(ExportArgs),
    /// Print a digest of a model's content (table names, ids, slot rows, dense tensors),
    /// independent of shard count, file layout and row order. Works on a checkpoint or on plain
    /// safetensors (e.g. an export), in bounded memory: a plain input's rows are sorted by
    /// bucket in nameless temporary files in $TMPDIR (or /tmp).
    #[command(
        after_help = "Example:\n  test \"$(saver digest /ckpt/a)\" = \"$(saver digest /ckpt/a-resharded)\""
    )]
    Digest(DigestArgs),
    /// List the committed steps of a managed root: step, full or delta, chain length, size,
    /// when it was started, writers; and what else the root holds (saves under way or crashed).
    #[command(after_help = "Example:\n  saver list /ckpt/run7 --json")]
    List(ListArgs),
    /// Print the newest committed step of a managed root and its path. Exit status 3 when the
    /// root holds no committed step.
    #[command(after_help = "Example:\n  saver load \"$(saver latest /ckpt/run7 | cut -f2)\"")]
    Latest(LatestArgs),
    /// Apply retention to a managed root: keep the newest K steps (and every link their chains
    /// need), every Nth, pinned ones; remove the rest, newest first, so that every step left is
    /// whole if it is interrupted. Without flags, the root's policy.
    #[command(
        after_help = "Example:\n  saver prune /ckpt/run7 --keep-latest 3 --keep-every 10000 --dry-run"
    )]
    Prune(PruneArgs),
    /// Reclaim what crashed saves and interrupted removals left in a managed root: a save's files
    /// only once every writer of it has provably ended.
    #[command(after_help = "Example:\n  saver clean /ckpt/run7 --dry-run")]
    Clean(CleanArgs),
}

/// Flags of `saver inspect`.
#[derive(Args, Debug)]
pub(crate) struct InspectArgs {
    /// Checkpoint directory.
    pub dir: PathBuf,
    #[command(flatten)]
    pub out: Output,
}

/// Flags of `saver verify`.
#[derive(Args, Debug)]
pub(crate) struct VerifyArgs {
    /// Checkpoint directory.
    pub dir: PathBuf,
    /// Reader threads.
    #[arg(long, default_value_t = default_parallel())]
    pub parallel: usize,
    #[command(flatten)]
    pub out: Output,
}

/// Compression of the checkpoint a command writes.
#[derive(Args, Debug, Clone, Copy)]
pub(crate) struct CompressFlags {
    /// Compress each tensor where it pays: ids, mostly-zero rows and low-precision values
    /// shrink, fp32 embeddings hardly do (see docs/GUIDE.md). Files stay safetensors, compressed
    /// tensors stored as U8; the format version becomes 3 (4 for a delta), which earlier saver
    /// builds refuse rather than misread.
    #[arg(long, value_enum)]
    pub compress: Option<CompressWith>,
    /// zstd level with --compress: 1 (fastest) to 19.
    #[arg(long, default_value_t = 1, requires = "compress",
          value_parser = clap::value_parser!(i32).range(1..=19))]
    pub compress_level: i32,
}

impl CompressFlags {
    /// The plan's compression option.
    pub(crate) fn compression(&self) -> Option<saver_core::Compression> {
        self.compress
            .map(|CompressWith::Zstd| saver_core::Compression {
                level: self.compress_level,
            })
    }
}

/// Values of `--compress`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CompressWith {
    /// zstd, per frame of each tensor, after a filter chosen per tensor.
    Zstd,
}

/// How `saver reshard` and `saver compact` write the checkpoint they rewrite.
#[derive(Args, Debug)]
pub(crate) struct RewriteFlags {
    /// Writer threads.
    #[arg(long, default_value_t = default_parallel())]
    pub parallel: usize,
    /// Replace a committed checkpoint in the destination.
    #[arg(long)]
    pub overwrite: bool,
    /// Skip fsync (faster, not crash-safe).
    #[arg(long)]
    pub no_fsync: bool,
    #[command(flatten)]
    pub compress: CompressFlags,
    #[command(flatten)]
    pub out_fmt: Output,
}

/// Flags of `saver reshard`.
#[derive(Args, Debug)]
pub(crate) struct ReshardArgs {
    /// Source checkpoint directory.
    pub src: PathBuf,
    /// Destination directory.
    #[arg(long)]
    pub out: PathBuf,
    /// Number of shards of the new checkpoint.
    #[arg(long)]
    pub shards: u32,
    #[command(flatten)]
    pub write: RewriteFlags,
}

/// Flags of `saver compact`.
#[derive(Args, Debug)]
pub(crate) struct CompactArgs {
    /// Source checkpoint directory (a delta, or a full checkpoint).
    pub src: PathBuf,
    /// Destination directory.
    #[arg(long)]
    pub out: PathBuf,
    /// Shards of the full checkpoint (default: the delta's).
    #[arg(long)]
    pub shards: Option<u32>,
    #[command(flatten)]
    pub write: RewriteFlags,
}

/// Flags of `saver export`.
#[derive(Args, Debug)]
pub(crate) struct ExportArgs {
    /// Source checkpoint directory.
    pub src: PathBuf,
    /// Destination directory.
    #[arg(long)]
    pub out: PathBuf,
    /// Largest file, e.g. 2GiB.
    #[arg(long, default_value = "2GiB", value_parser = parse_size)]
    pub max_file_size: u64,
    /// Leave out slots matching this glob.
    #[arg(long)]
    pub exclude_slots: Vec<String>,
    /// Export only tables matching this glob.
    #[arg(long)]
    pub tables: Vec<String>,
    /// Cast floating slots and dense tensors.
    #[arg(long, value_enum)]
    pub dtype: Option<CastDtype>,
    /// Quantize the embedding slots row-wise for serving (FBGEMM's layouts), e.g. int4.
    #[arg(long, value_enum)]
    pub quantize: Option<QuantizeBits>,
    /// Layout of quantized rows: fused (int8: D bytes, f32 scale, f32 bias; int4/int2: packed
    /// values, f16 scale, f16 bias), fused-half (f16 scale and bias at every bit rate), or split
    /// (TorchRec: `<slot>` values, `<slot>_qscale` and `<slot>_qbias` in f16).
    #[arg(long, value_enum, default_value = "fused", requires = "quantize")]
    pub quantize_layout: QuantizeLayout,
    /// Slots to quantize (globs, comma-separated or repeated).
    #[arg(
        long,
        default_value = "embedding",
        value_delimiter = ',',
        requires = "quantize"
    )]
    pub quantize_slots: Vec<String>,
    /// Replace an existing export in the destination.
    #[arg(long)]
    pub overwrite: bool,
    #[command(flatten)]
    pub out_fmt: Output,
}

/// Flags of `saver digest`.
#[derive(Args, Debug)]
pub(crate) struct DigestArgs {
    /// Checkpoint directory, plain safetensors directory or file.
    pub path: PathBuf,
    /// Reader threads.
    #[arg(long, default_value_t = default_parallel())]
    pub parallel: usize,
    /// Digest definition (docs/FORMAT.md): 2 streams; 1, rows by id, holds the model in
    /// memory and is kept for digests recorded before version 2.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u8).range(1..=2))]
    pub digest_version: u8,
    #[command(flatten)]
    pub out: Output,
}

/// A managed root's policy, as `saver save --root` takes it: flags given override the policy the
/// root keeps, and are kept.
#[derive(Args, Debug, Default, Clone)]
pub(crate) struct PolicyArgs {
    /// With --root: a full checkpoint every N saves, deltas between (1: every save full).
    #[arg(long)]
    pub full_every: Option<u32>,
    /// With --root: most links of a chain, its full checkpoint included.
    #[arg(long)]
    pub max_chain_links: Option<usize>,
    #[command(flatten)]
    pub retention: RetentionArgs,
}

/// What retention keeps, as `saver save --root` and `saver prune` take it.
#[derive(Args, Debug, Default, Clone)]
pub(crate) struct RetentionArgs {
    /// Keep the newest K committed steps (and every link their chains need).
    #[arg(long)]
    pub keep_latest: Option<usize>,
    /// Also keep every step that is a multiple of N.
    #[arg(long)]
    pub keep_every: Option<u64>,
    /// Also keep the newest step of every period of this many seconds (86400: one a day).
    #[arg(long)]
    pub keep_one_per_seconds: Option<u64>,
    /// Also keep this step (repeatable).
    #[arg(long)]
    pub keep_step: Vec<u64>,
}

/// Flags of `saver list`.
#[derive(Args, Debug)]
pub(crate) struct ListArgs {
    /// The managed root.
    pub root: PathBuf,
    #[command(flatten)]
    pub out: Output,
}

/// Flags of `saver latest`.
#[derive(Args, Debug)]
pub(crate) struct LatestArgs {
    /// The managed root.
    pub root: PathBuf,
    #[command(flatten)]
    pub out: Output,
}

/// Flags of `saver prune`.
#[derive(Args, Debug)]
pub(crate) struct PruneArgs {
    /// The managed root.
    pub root: PathBuf,
    #[command(flatten)]
    pub retention: RetentionArgs,
    /// Say what would be removed, remove nothing.
    #[arg(long)]
    pub dry_run: bool,
    #[command(flatten)]
    pub out: Output,
}

/// Flags of `saver clean`.
#[derive(Args, Debug)]
pub(crate) struct CleanArgs {
    /// The managed root.
    pub root: PathBuf,
    /// Say what would be reclaimed, remove nothing.
    #[arg(long)]
    pub dry_run: bool,
    #[command(flatten)]
    pub out: Output,
}

/// Flags of `saver load`.
#[derive(Args, Debug)]
pub(crate) struct LoadArgs {
    /// Checkpoint directory, or a managed root with --step.
    pub dir: PathBuf,
    /// DIR is a managed root: load this step, or `latest` (the newest committed one).
    #[arg(long)]
    pub step: Option<String>,
    /// With --step latest: if the newest step does not verify (a CRC32 fails, a file is
    /// missing), load the newest one that does, and say which on stderr.
    #[arg(long, requires = "step")]
    pub fallback: bool,
    /// Number of target shards M.
    #[arg(long, default_value_t = 1)]
    pub shards: u32,
    /// Load only target shard J of M.
    #[arg(long)]
    pub shard_index: Option<u32>,
    /// Reader threads.
    #[arg(long, default_value_t = default_parallel())]
    pub parallel: usize,
    /// What to load into: concurrent hashtables (as a trainer resumes) or contiguous arrays
    /// (as a serving system or a tool reads them; the fastest owning load).
    #[arg(long, value_enum, default_value = "tables")]
    pub into: LoadTarget,
    /// With --into arrays: back the arrays with transparent huge pages (faster when the kernel
    /// has huge pages free; may stall while it compacts memory when it has not).
    #[arg(long)]
    pub huge_pages: bool,
    /// Skip the content digest of what was loaded (a SHA-256 over every row in id order, which
    /// on large checkpoints takes longer than the load itself). The load still checks every
    /// CRC32.
    #[arg(long)]
    pub no_digest: bool,
    #[command(flatten)]
    pub out: Output,
}

/// Flags of `saver save`.
#[derive(Args, Debug)]
pub(crate) struct SaveArgs {
    /// Checkpoint directory to write.
    #[arg(long, required_unless_present = "root", conflicts_with = "root")]
    pub out: Option<PathBuf>,
    /// Save into a managed root (a directory or s3://…) as step --step: full or delta by the
    /// root's policy, retention applied after the commit (see `saver list`).
    #[arg(long, requires = "step", conflicts_with = "parent")]
    pub root: Option<PathBuf>,
    /// With --root: save this step full whatever the policy says (after a change the policy
    /// cannot see, or to start a new chain).
    #[arg(long, requires = "root")]
    pub full: bool,
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// Generate the model: a preset (tiny, small, criteo-kaggle) and/or key=value pairs (tables,
    /// rows, dim, slots, dense, seed, scale; kind=rows for row-range tables, and touched=P to
    /// change P percent of their rows, a model to save as a delta of the untouched one).
    #[arg(long, conflicts_with = "from", required_unless_present = "from")]
    pub synthetic: Option<String>,
    /// Read the model from a plain safetensors file/directory or a saver checkpoint.
    #[arg(long)]
    pub from: Option<PathBuf>,
    /// Save a delta of this checkpoint (full, or itself a delta): only the rows inserted or
    /// changed since it, whole, and the ids removed since it, found by comparing rows.
    #[arg(long)]
    pub parent: Option<PathBuf>,
    /// Number of shards N.
    #[arg(long, default_value_t = 1)]
    pub shards: u32,
    /// Write only shard I of N (one process of a multi-process save); commits if it completes the set.
    #[arg(long)]
    pub shard_index: Option<u32>,
    /// Writer threads.
    #[arg(long, default_value_t = default_parallel())]
    pub parallel: usize,
    /// Largest data file, e.g. 512MiB.
    #[arg(long, default_value = "2GiB", value_parser = parse_size)]
    pub max_file_size: u64,
    /// Most memory the plan may hold of sorted ids and row handles (16 bytes a row); tables past
    /// it wait in nameless temporary files in --out until written (a plain safetensors input's
    /// rows are listed again by bucket instead: no such files). The default keeps a save
    /// within about 64 MiB + 8 MiB per writer thread beyond the model; raise it (e.g. 1GiB) to
    /// spare a network filesystem the spill's extra 16 bytes a row of I/O.
    #[arg(long, default_value = "16MiB", value_parser = parse_size)]
    pub plan_memory: u64,
    /// With --from a plain safetensors input: distribute each table of more than one group in N
    /// rounds, each a read of the whole input (1: a single pass). By default a table larger than
    /// the kernel's dirty-page limit that fits twice in the available memory takes as many
    /// rounds as keep its temporary rows in the page cache (at most 8), others one pass.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub import_rounds: Option<u32>,
    /// Leave out slots matching this glob (repeatable).
    #[arg(long)]
    pub exclude_slots: Vec<String>,
    /// Save only tables matching this glob (repeatable: a table matching any is kept).
    #[arg(long)]
    pub tables: Vec<String>,
    /// Keep only rows whose scalar slot satisfies SLOT>=VALUE (also >, <=, <, ==, !=; repeatable).
    #[arg(long)]
    pub keep_rows: Vec<String>,
    /// Replace a committed checkpoint in --out (the old one stays loadable until the new commit).
    #[arg(long)]
    pub overwrite: bool,
    /// Skip fsync (faster, not crash-safe).
    #[arg(long)]
    pub no_fsync: bool,
    /// Write data files with direct I/O (O_DIRECT, around the page cache): auto (durable saves on
    /// ext4 and XFS), on wherever the filesystem accepts it (`--direct-io` alone), or off.
    #[arg(
        long,
        value_enum,
        default_value_t = DirectIoWhen::Auto,
        num_args = 0..=1,
        default_missing_value = "on",
        require_equals = true
    )]
    pub direct_io: DirectIoWhen,
    #[command(flatten)]
    pub compress: CompressFlags,
    /// Save id: part of every file name. Default: random. Required with --shard-index: the same
    /// in every process of one save, and new for every save and every retry (e.g.
    /// run7-step1200-a1); a second writer of a shard under one id gets the save rejected.
    #[arg(long)]
    pub save_id: Option<String>,
    /// The trainer step, stored in the manifest; every process of a save must give the same.
    /// With --root, the step to save.
    #[arg(long)]
    pub step: Option<u64>,
    /// With --shard-index: wait up to this many seconds (0 to 604800) for the other shards and
    /// the commit.
    #[arg(long, allow_hyphen_values = true)]
    pub wait_seconds: Option<String>,
    #[command(flatten)]
    pub out_fmt: Output,
}

/// Values of `save --direct-io`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DirectIoWhen {
    /// Durable saves on local disk filesystems that do it well (ext4, XFS).
    Auto,
    /// Wherever the filesystem accepts O_DIRECT.
    On,
    /// Always through the page cache.
    Off,
}

/// Targets of `load --into`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LoadTarget {
    /// `EmbeddingTable`s, one per table and target shard.
    Tables,
    /// Contiguous arrays per table (ids and one array per slot).
    Arrays,
}

/// Cast targets of `export --dtype`.
#[derive(ValueEnum, Clone, Copy, Debug)]
pub(crate) enum CastDtype {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
}

/// Bit rates of `export --quantize`.
#[derive(ValueEnum, Clone, Copy, Debug)]
pub(crate) enum QuantizeBits {
    /// 8 bits a value.
    Int8,
    /// 4 bits a value, two a byte.
    Int4,
    /// 2 bits a value, four a byte.
    Int2,
}

/// Layouts of `export --quantize-layout`.
#[derive(ValueEnum, Clone, Copy, Debug)]
pub(crate) enum QuantizeLayout {
    /// FBGEMM's fused rows: Fused8BitRowwiseQuantizedSBFloat at int8,
    /// FusedNBitRowwiseQuantizedSBHalf at int4 and int2.
    Fused,
    /// FusedNBitRowwiseQuantizedSBHalf at every bit rate.
    FusedHalf,
    /// TorchRec's split form: values, scales and biases as three tensors.
    Split,
}

fn parse_size(s: &str) -> Result<u64, String> {
    saver_core::synthetic::parse_size(s)
        .ok_or_else(|| format!("{s:?} is not a size (e.g. 512MiB, 2GiB, 1048576)"))
}

fn default_parallel() -> usize {
    std::thread::available_parallelism().map_or(2, usize::from)
}

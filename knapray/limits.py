"""Upper bounds on the sizes, counts and products a user gives (command-line flags, data
codes, run configs), checked up front so that a typo such as ``g99999999b99999...`` is one
line naming the value and the bound instead of a 70 TiB allocation or a machine killed
for memory. Each bound is far above any real run (docs/cli.md lists them, and why).

Constants only: the planning package, the flags and the run config all read them.
"""

from __future__ import annotations

MAX_WORLD_SIZE = 1 << 20
"""Ranks of a world, a mix or a topology: 1,048,576 (the largest clusters hold ~10^5 GPUs)."""

MAX_LOCAL_PROCESSES = 64
"""Processes a command starts on this machine (``knapray parity``/``reference``: one
gloo process per rank)."""

MAX_STEPS = 1_000_000_000
"""Steps of a run, a plan, a simulation or a sampler: a billion."""

MAX_SAMPLES_PER_RANK = 1 << 16
"""Samples one rank draws per step (a data code's B, ``data.samples_per_step``): 65,536."""

MAX_GLOBAL_BATCH = 1 << 20
"""Samples per step over the world (``data.global_batch``): 1,048,576."""

MAX_MICRO_BATCHES = 1 << 16
"""Micro-batches of an optimizer step (``optim.grad_accum_steps``), and ``parallel.ac_every``."""

MAX_RESOLUTION = 1 << 15
"""A data code's side in pixels (R): 32,768."""

MAX_FRAMES = 1 << 16
"""A data code's frames (F): 65,536."""

MAX_SEQUENCE_TOKENS = 1 << 22
"""Visual tokens of one sample of a data code: 4,194,304 (a 2048x2048 85-frame video
holds 409,600)."""

MAX_RANK_TOKENS = 1 << 26
"""Tokens one rank holds in a step (B samples of a data code; ``data.max_tokens_per_gpu``):
67,108,864 (64 times a 1M-token budget)."""

MAX_STEP_SEQUENCES = 1 << 22
"""Sequences of one step over the world (every rank's B, summed): 4,194,304."""

MAX_PLANNED_SEQUENCES = 1 << 25
"""Sequences that ``knapray plan``/``simulate`` hold at once (steps times sequences per
step): 33,554,432, about 2 GB of lengths in memory."""

MAX_TEXT_LENGTH = 1 << 16
"""Text tokens of one sample (``--max-text-tokens``): 65,536 (T5 takes 512)."""

MAX_SEED = (1 << 63) - 1
"""Seeds are 64-bit (torch.manual_seed's range)."""

MAX_EPOCHS = 1_000_000
"""Passes over a corpus."""

MAX_TIMEOUT_S = 10_000_000
"""Timeouts and intervals in seconds (``distributed.timeout_s``): about 115 days."""

MAX_CORPUS_SAMPLES = 1 << 27
"""Samples of a synthetic corpus (its per-sample columns are built in memory): 134,217,728."""

MAX_EMBED_DIM = 1 << 16
"""Channels and embedding widths of a corpus (synthetic or ingested): 65,536."""

MAX_SHUFFLE_BUFFER_MB = 1 << 16
"""MiB of corpus rows one training worker shuffles among (``data.shuffle_buffer_mb``): 64 GiB,
more host memory than a GPU's share of any node (Ray's buffer holds up to twice this)."""

MAX_SHARDS = 1 << 20
"""Parquet files of a corpus (synthetic or ingested)."""

MAX_SCALE = 1 << 12
"""``--scale``: the divisor of resolutions (and text lengths) that makes a CPU-sized copy of a
mix (synthetic corpora, parity, the step and rivals benchmarks): 4,096."""

MAX_IMAGE_SIDE = 8192
"""``knapray sample``: the longest side of an image in pixels (FLUX.1 is trained up to
2048; 8192 allows panoramas and upscales)."""

SIZE_FORM = r"([0-9]+)x([0-9]+)"
"""The one spelling of an image size (``re.fullmatch``), wherever a user gives one (``--size``,
``metrics.validation.sizes``, a served request's ``size``, as OpenAI's images API writes it):
WIDTHxHEIGHT in ASCII digits and a lowercase x; ``512X512`` or ``512 x 512`` is refused."""

MAX_CONDITION_IMAGE_BYTES = 1 << 25
"""``knapray sample --image``: bytes of a conditioning image's file, 32 MiB (a 4096x4096
PNG of a photograph is about 30 MB; a served request's image is bounded by its body first)."""

MAX_CONDITION_IMAGE_PIXELS = MAX_IMAGE_SIDE * MAX_IMAGE_SIDE
"""``knapray sample --image``: pixels of a conditioning image as its header states them, read
before it is decoded (a small PNG may claim billions): 67,108,864, a side of ``MAX_IMAGE_SIDE``."""

MAX_IMAGE_TOKENS = 1 << 16
"""``knapray sample``: image tokens of one request: 65,536, a 4096x4096 image at a VAE
factor of 8 and 2x2 patches (FLUX.1 at 2048x2048 holds 16,384)."""

MAX_SAMPLE_BATCH_TOKENS = 1 << 18
"""``knapray sample``: image tokens of all requests together (one packed batch per Euler
step): 262,144."""

MAX_RUN_NAME = 128
"""Characters of ``run.name`` (a directory, a Ray actor and a tracker run are named after it)."""

MAX_MODEL_WIDTH = 1 << 16
"""A model's width, channels, text and pooled widths (``model.hidden_size``, ...): 65,536
(FLUX.1 is 3072 wide; the widest published DiTs are under 20,000)."""

MAX_MODEL_DEPTH = 1 << 12
"""Transformer blocks of one kind, and attention heads: 4,096 (FLUX.1: 19 + 38 blocks, 24 heads)."""

MAX_MODEL_PARAMS = 1 << 40
"""Parameters of a model: about 1.1 trillion (FLUX.1 has 11.9 billion): a model larger
than this cannot be trained on any cluster knapray targets, and building it would only
exhaust the workers' memory."""

MAX_BENCH_LEDGER_ROWS = 1 << 28
"""``knapray bench ledger --sizes``: rows of one benchmarked ledger, 268,435,456 (about
4 GB in memory; the bench's default largest is 10 million)."""

MAX_PICKLE_OPS = 1 << 26
"""Opcodes (each makes at most one object) a checkpoint's DCP ``.metadata`` may hold:
67,108,864. A 12B model sharded over 64 ranks with its optimizer state writes about 30 MB
of metadata, a few million opcodes."""

MAX_PICKLE_DEPTH = 64
"""Nested containers being built at once in a ``.metadata`` (DCP's nest about 6 deep)."""

MAX_PICKLE_REFS = 1 << 24
"""References to already-built objects (memo reads) in a ``.metadata``: 16,777,216. A
planted file shares one list 64 times per level to make a checker walk 64^12 nodes."""

MAX_METADATA_NODES = 1 << 24
"""Containers and values the metadata checker visits, each once however often shared."""

MAX_SAMPLE_REQUESTS = 64
"""``knapray sample``: requests of one call (each is a tile of the PNG grid it writes; more
in several calls)."""

MAX_DRYRUN_WORLD = 1 << 16
"""``knapray dryrun --world-size``: 65,536 ranks. The dry run draws every rank's samples and
makes the rank's groups in one process (it plans only its own balance group): 2^20 ranks
took minutes there (the general bound is ``MAX_WORLD_SIZE``)."""

MAX_DRYRUN_PER_STEP_WORLD = 1 << 13
"""``knapray dryrun --world-size`` of a run whose topology is chosen every step
(``balance.topology: per-step``): 8,192 ranks. Its plan weighs block layouts of every node
of the world together (about 3 ms a rank here: 4,096 ranks took 11 s)."""

MAX_BENCH_COORDINATOR_RANKS = 1 << 13
"""``knapray bench coordinator --ranks``: 8,192 simulated ranks, twice the largest world in
docs/results.md. The bench plays every rank's calls on this machine's Ray: 8,192 took 47 s
here (2 cores, loaded), 16,384 did not answer in 400 s, 1,048,576 ran 126 s into an
ActorUnavailableError."""

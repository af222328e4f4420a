"""Typed schema of a run's configuration.

Every YAML file under ``conf/`` and ``recipes/`` is merged onto :class:`RunConfig`
at compose time, so a misspelt key or a wrongly typed value fails while Hydra
composes the config, naming the full key. Each dataclass mirrors the constructor
(or function) that consumes it, one key to one argument.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

# the model's part of the schema, with its field roles (also importable from here)
from recipes_lib.config.model import COMPUTE as COMPUTE
from recipes_lib.config.model import CONTEXT as CONTEXT
from recipes_lib.config.model import LABEL as LABEL
from recipes_lib.config.model import SHAPE as SHAPE
from recipes_lib.config.model import ModelConfig as ModelConfig
from recipes_lib.config.model import RopeScalingConfig as RopeScalingConfig
from recipes_lib.config.model import model_fields as model_fields
from recipes_lib.config.model import resolved_model_fields as resolved_model_fields


@dataclass
class KernelsConfig:
    """Kernel choices; ``attention`` is one of ``sdpa`` | ``flex`` | ``varlen`` |
    ``flash_attn`` | ``auto``, the backend of every attention layer; ``attention_local``
    and ``attention_global`` (null: as ``attention``) name the backend of the
    sliding-window layers and of the others (:mod:`recipes_lib.kernels.choice`; ``auto``:
    flex for a window or a document mask, SDPA's flash kernel for global causal layers).

    ``loss_chunk_size`` fuses the output projection with the loss of every objective
    (:class:`recipes_lib.models.head.OutputHead`: the cross-entropy, or the label
    log-probs of preference objectives) so the full ``(B*T, V)`` logits never exist;
    worth it for large vocabularies. On in the post-training recipes. Not under
    DeepSpeed.
    """

    attention: str = "sdpa"
    attention_local: str | None = None  # the window layers' backend; null: as attention
    attention_global: str | None = None  # the other layers' backend; null: as attention
    # torch.compile each transformer block; null: on when training on a CUDA GPU
    compile: bool | None = False
    # where inductor and Triton keep compiled kernels between runs (a run that finds its
    # blocks' graphs there skips most of its compile); beside the data cache, so it
    # outlives a job's private /tmp. null: torch's own (/tmp/torchinductor_<user>).
    # TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR, when set, win
    compile_cache: str | None = "${oc.env:RECIPES_CACHE,'~/.cache/recipes_lib'}/compile"
    loss_chunk_size: int | None = None  # fused output + loss, N rows at a time; None: off
    # recompute blocks' activations in the backward pass instead of storing them: off
    # (or false) | full (or true: every block) | selective (every checkpoint_every-th
    # block) | auto (the fastest that fits the card or run.memory_budget_gib, with the
    # loss chunk and micro-batch: recipes_lib.launch_check.autofit)
    activation_checkpointing: str = "off"
    checkpoint_every: int = 2  # selective: blocks 0, N, 2N, ... are recomputed
    # the block inputs that checkpointing keeps go to pinned host memory and come back for
    # the backward, overlapped with compute (recipes_lib.kernels.offload); needs
    # checkpointing. Under checkpointing auto, auto-fit turns it on when nothing else fits
    activation_offload: bool = False
    # a mixture's experts: auto (one grouped GEMM per weight on CUDA in bf16, else a loop
    # over the experts) | grouped | loop
    experts: str = "auto"

    def __post_init__(self) -> None:
        self.activation_checkpointing = checkpointing_mode(self.activation_checkpointing)
        if self.checkpoint_every < 1:
            raise ValueError(
                f"kernels.checkpoint_every must be 1 or more, got {self.checkpoint_every}"
            )
        if self.activation_offload and self.activation_checkpointing == "off":
            raise ValueError(
                "kernels.activation_offload=true moves the block inputs that activation "
                "checkpointing keeps: set kernels.activation_checkpointing to full, "
                "selective or auto"
            )

    def checkpoint_stride(self) -> int:
        """Every how many blocks one is recomputed: 0 none, 1 all, N one in N (``auto``
        counts as none until :mod:`recipes_lib.launch_check.autofit` resolves it)."""
        mode = checkpointing_mode(self.activation_checkpointing)
        return {"off": 0, "auto": 0, "full": 1}.get(mode, self.checkpoint_every)


CHECKPOINTING_MODES = ("off", "full", "selective", "auto")


def checkpointing_mode(value: Any) -> str:
    """``kernels.activation_checkpointing`` as one of :data:`CHECKPOINTING_MODES`
    (true and false, as booleans or strings of any case, are full and off)."""
    text = str(value).strip().lower()
    text = {"true": "full", "false": "off"}.get(text, text)
    if text not in CHECKPOINTING_MODES:
        raise ValueError(
            f"kernels.activation_checkpointing={value!r}: use one of off, full, selective, auto"
        )
    return text


@dataclass
class SourceConfig:
    """One raw text source of a data mixture.

    Exactly one of ``path`` (a local file or directory of .txt/.jsonl/.json/.parquet),
    ``hub`` (a ``datasets`` hub name) or ``builtin`` (``stdlib``: the Python standard
    library's own source files) names where the text comes from.
    """

    path: str | None = None
    hub: str | None = None
    builtin: str | None = None
    subset: str | None = None  # hub configuration name
    split: str = "train"
    text_field: str = "text"
    streaming: bool = False
    max_documents: int | None = None
    weight: float = 1.0  # relative sampling weight in the mixture


@dataclass
class TokenizerConfig:
    """Load ``path`` (a tokenizer.json or a directory holding one) or train a byte-level BPE."""

    path: str | None = None
    vocab_size: int = 8192  # for training; must not exceed model.vocab_size
    train_max_bytes: int = 20_000_000  # text sampled to train a new tokenizer
    eos_token: str = "<|endoftext|>"


@dataclass
class ChatFormatConfig:
    """How SFT and preference records are read and rendered (objectives sft and dpo).

    A chat record is a ``messages_field`` list of ``{role, content}`` turns, or a
    ``prompt_field``/``response_field`` pair; a preference record adds
    ``chosen_field``/``rejected_field`` (plain strings or message lists); an unpaired
    (KTO) record a ``completion_field`` and a boolean ``label_field``.
    """

    messages_field: str = "messages"
    prompt_field: str = "prompt"
    response_field: str = "response"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    completion_field: str = "completion"  # KTO: one completion of the prompt
    label_field: str = "label"  # KTO: true where the completion is desirable
    chat_template: str | None = None  # Jinja template; None: the tokenizer's, else built in
    packing: bool = True  # several conversations per sequence, with document masking
    # right | left | drop | turn: what to do with over-long samples (turn: SFT conversations
    # cut after the last whole turn that fits, never inside a tool round; dropped if none)
    truncation: str = "right"
    format: str = "auto"  # auto | messages | prompt_response | sharegpt | alpaca
    train_on: str = "all"  # all | last | without_reasoning: the assistant turns trained on
    enable_thinking: bool | None = None  # the template's thinking switch; None: not given
    on_bad_record: str = "error"  # error | skip (skips are counted and reported)
    # a record with more text than this (bytes) is a bad record; null: no limit
    max_record_bytes: int | None = 4_000_000
    # recipes-check, recipes-prepare: this many records of each source also rendered by
    # transformers and compared token for token, trained token for trained token (0: none)
    prove_masks: int = 0
    # recipes-prepare: print this many rendered examples of each source, trained tokens
    # highlighted, and the counts of trained and untrained tokens (0: none)
    show: int = 0


def _as_source(name: str, value: Any) -> SourceConfig:
    """One ``data.sources`` entry as a :class:`SourceConfig`, its keys and types checked
    (a bad one raises ``ValueError`` naming ``data.sources.<name>.<key>``)."""
    if isinstance(value, SourceConfig):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(
            f"data.sources.{name} must be a mapping such as {{path: data.jsonl}}, got {value!r}"
        )
    try:
        typed = OmegaConf.merge(OmegaConf.structured(SourceConfig), dict(value))
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        raise ValueError(f"data.sources.{name}.{key}: {str(err).splitlines()[0]}") from err
    return OmegaConf.to_object(typed)  # type: ignore[return-value]


@dataclass
class DataConfig:
    """Where text comes from and how it becomes packed training sequences.

    ``path`` is the one-source shorthand: a file or folder of your own data (``.txt``,
    ``.jsonl``, ``.json``, ``.parquet``: pretraining text, chat records or preference
    pairs by the objective). It replaces ``sources``; for a mixture name each source
    under ``sources`` instead (``+data.sources.NAME={path: ...}``). With neither, the
    objective's built-in data is used.
    """

    path: str | None = None
    # name -> SourceConfig. Typed as Any so that a new entry can be added from the
    # command line (OmegaConf cannot assign a plain mapping to a dict of dataclasses);
    # each entry is checked and converted to a SourceConfig when the config is built.
    sources: dict[str, Any] = field(default_factory=dict)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    seq_len: int = 256
    batch_size: int = 8  # micro-batch per device
    val_fraction: float = 0.02  # documents held out for validation
    document_mask: bool = False  # attend only within a document in packed sequences
    cache_dir: str = "${oc.env:RECIPES_CACHE,'~/.cache/recipes_lib'}"
    num_proc: int = 0  # tokenizer threads: 1 for one thread, otherwise all cores
    num_workers: int = 0  # DataLoader workers
    seed: int = "${run.seed}"  # type: ignore[assignment]
    chat: ChatFormatConfig = field(default_factory=ChatFormatConfig)

    def __post_init__(self) -> None:
        self.sources = {name: _as_source(name, value) for name, value in self.sources.items()}


@dataclass
class BatchRampConfig:
    """The global batch grown by gradient accumulation from ``start`` micro-batches per
    step to ``trainer.accumulate_grad_batches`` over ``tokens`` (0: no ramp); ``lr``:
    ``constant`` | ``sqrt`` (scaled by the square root of the batch's fraction of the
    full one). See ``recipes_lib.optim.batch_ramp``."""

    start: int = 1
    tokens: int = 0
    lr: str = "constant"


@dataclass
class StageConfig:
    """The objective a run trains, how long, what it starts from and what it hands on.

    The objective's own settings are ``stage.<objective>`` (``stage.dpo.beta``): the
    run schema's stage node has a typed field for each objective that declares settings
    (:mod:`recipes_lib.config.objectives`).

    ``init_from`` is a ``.safetensors`` file, a directory holding ``model.safetensors``
    or a Lightning ``.ckpt``; with ``init_optimizer`` (a ``.ckpt`` only) the AdamW
    moments come along too, while learning rates and the schedule start afresh from
    this run's ``optim`` and ``scheduler``. After fit, the stage's output weights
    (``<run.dir>/model.safetensors``) are the final weights, the mean of the last
    ``average_last_k`` step checkpoints, or the ``ema_decay`` moving average.
    """

    objective: str = "pretrain"
    max_tokens: int | None = None  # when set, overrides trainer.max_steps
    init_from: str | None = None  # weights (or a .ckpt) that start this stage
    init_optimizer: bool = False  # also load the optimizer state of the init_from .ckpt
    # init_from is a dense model and this one a mixture of experts: each expert starts as
    # a copy of its layer's MLP, the routers fresh (recipes_lib.checkpoint.upcycle)
    upcycle: bool = False
    average_last_k: int | None = None  # output: mean of the last K step checkpoints
    ema_decay: float | None = None  # output: exponential moving average of the weights
    # hf/: the output weights also as a Hugging Face folder, checked against transformers;
    # None: when the stage starts from one (or from a stage that wrote one)
    export_hf: bool | None = None
    batch_ramp: BatchRampConfig = field(default_factory=BatchRampConfig)


@dataclass
class AdapterConfig:
    """Parameter-efficient fine-tuning applied to the model in ``configure_model``.

    ``kind``: ``none`` | ``lora`` (peft LoRA on the native model) | ``qlora`` (LoRA over
    frozen 4-bit NF4 base linears through bitsandbytes; CUDA only).
    """

    kind: str = "none"
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: list[str] = field(
        default_factory=lambda: ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]
    )
    # lora: the frozen projections' storage dtype: auto (bf16 under precision=bf16-mixed,
    # where autocast computes them in bf16 anyway) | float32 | bfloat16
    base_dtype: str = "auto"
    double_quant: bool = True  # qlora: quantise the quantisation constants too
    compute_dtype: str = "bfloat16"  # qlora: dtype of the dequantised matmuls


@dataclass
class OptimConfig:
    """The optimizer (``name``: adamw | adamw_8bit | adafactor | muon | any ``torch.optim``
    class; ``args``: its further keyword arguments, see ``recipes_lib.optim.choices``),
    with decoupled weight decay; norms, biases and embeddings are not decayed."""

    name: str = "adamw"
    lr: float = 3e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay_embeddings: bool = False
    fused: bool | None = None  # None: fused on CUDA, for-each elsewhere
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class SchedulerConfig:
    """Learning-rate schedule. Durations are counted in ``unit`` (steps | tokens).

    ``name``: ``cosine`` (warmup then cosine to ``min_lr_ratio``), ``wsd``
    (warmup, stable, then ``decay`` of the run's end), ``linear`` (warmup then linear
    to ``min_lr_ratio``) or ``constant`` (warmup then flat).
    """

    name: str = "cosine"
    unit: str = "steps"
    warmup: int = 0
    decay: int | None = None  # wsd only: length of the final decay phase
    decay_shape: str = "linear"  # wsd decay: linear | cosine | sqrt
    min_lr_ratio: float = 0.1


@dataclass
class StrategyConfig:
    """How the run is spread over devices (config group ``strategy``).

    ``name``: ``single`` (one device) | ``ddp`` (replicated weights, all-reduced
    gradients) | ``fsdp`` (FSDP2: each block's parameters, gradients and optimizer state
    sharded with ``fully_shard`` through Lightning's ``ModelParallelStrategy``) | ``hsdp``
    (FSDP2 over a 2-D mesh: ``replicas`` copies, each sharded over its ranks) |
    ``deepspeed_zero2`` | ``deepspeed_zero3`` (Lightning's ``DeepSpeedStrategy``; needs
    the ``deepspeed`` extra).
    """

    name: str = "single"
    # fsdp: parameters, gradients and optimizer state live on the CPU between uses;
    # deepspeed: optimizer state (ZeRO-2) and parameters too (ZeRO-3) on the CPU
    cpu_offload: bool = False
    reshard_after_forward: bool = True  # fsdp: free gathered parameters after forward
    find_unused_parameters: bool = False  # ddp
    timeout_minutes: int = 30  # collective timeout of the process group
    # checkpoints written in the background (fsdp: DCP's async_save; single, ddp: a writer
    # thread); training waits only while the state is copied to host memory, and the end
    # of fit waits for the last one
    async_checkpoint: bool = False
    # fsdp: a mixture of experts' experts spread over the ranks (each keeps E / ranks of
    # them whole) with the tokens sent to them by all-to-all, instead of gathered
    expert_parallel: bool = False
    # hsdp: the copies of the model, each sharded over world / replicas ranks (FSDP2's
    # 2-D mesh: replicate across, shard within); None: trainer.num_nodes (one per node)
    replicas: int | None = None
    # ddp: each row split over this many ranks (context parallelism, for long rows): the
    # ranks of a group read the same rows and the data is sharded over world / N ranks;
    # data.seq_len must be a multiple of 2 x N (recipes_lib.parallel.context)
    context_parallel: int = 1


@dataclass
class PrecisionConfig:
    """Numeric precision of training (config group ``precision``).

    ``name``: ``auto`` (``bf16-mixed`` on a CUDA GPU that has bf16, else ``32-true``) |
    ``32-true`` | ``bf16-mixed`` (bf16 compute over fp32 weights) |
    ``bf16-true`` (weights and compute in bf16) | ``fp8`` (bf16-mixed, with the
    Linear layers' matmuls in float8 through torchao; CUDA with compute capability
    8.9 or newer). Under ``strategy=fsdp`` the mixed precisions become FSDP2's
    mixed-precision policy (bf16 parameters in compute, fp32 gradient reduction).
    """

    name: str = "32-true"
    fp8_recipe: str = "tensorwise"  # tensorwise | rowwise scaling of the float8 casts
    # Linear layers kept in bf16: fnmatch patterns of module names (the output head)
    fp8_skip: list[str] = field(default_factory=lambda: ["output"])
    # Linear layers with a dimension below this stay in bf16 (float8 casts cost more
    # than they save on small matmuls); both dimensions must also divide by 16
    fp8_min_features: int = 1024


@dataclass
class TrainerConfig:
    """Arguments of ``lightning.Trainer``, one to one (strategy and precision come from
    their own groups)."""

    accelerator: str = "auto"
    devices: Any = "auto"
    num_nodes: int = 1
    max_steps: int = 1000
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = 1.0
    val_check_interval: int | None = 200  # optimizer steps between validations
    limit_val_batches: int | None = 20
    num_sanity_val_steps: int = 0
    log_every_n_steps: int = 10
    deterministic: bool = False
    enable_progress_bar: bool = True
    enable_model_summary: bool = True


@dataclass
class GuardConfig:
    """What a run does about a non-finite (or, with ``spikes``, spiking) loss or gradient
    norm (any objective; see ``recipes_lib.training.guard``). Such an update is always
    skipped and counted.

    ``policy``: ``auto`` (``skip``, or ``off`` under DeepSpeed) | ``skip`` (go on) |
    ``rollback`` (start again from the newest checkpoint without the bad update, the
    sampler moved ``rollback_skip_batches`` batches on, the learning rate times
    ``rollback_lr_factor`` for ``rollback_lr_steps`` steps) | ``stop`` (save, end
    non-zero) | ``off`` (no checks).
    """

    policy: str = "auto"
    spikes: bool = False  # also judge spikes (else non-finite values only)
    window: int = 128  # steps the spike test compares with
    sigmas: float = 6.0  # a spike: this many standard deviations above their mean
    min_history: int = 64  # steps seen before spikes are looked for
    max_skipped: int = 20  # bad updates in a row: the run has diverged and stops
    max_rollbacks: int = 3  # rollbacks of one run; one more stops it
    rollback_skip_batches: int = 200  # optimizer steps' worth of batches moved past
    rollback_lr_factor: float = 1.0  # learning-rate multiplier after a rollback
    rollback_lr_steps: int = 0  # for this many steps after it
    inject_step: int | None = None  # drill: the batch of this step made bad (tests)
    inject: str = "nan"  # nan | spike


@dataclass
class RunInfoConfig:
    """Run-level settings: output folder, seed and resume point."""

    name: str = "run"
    dir: str = "outputs/${run.name}"
    seed: int = 1234
    # "last" (the newest checkpoint that verifies) or a checkpoint file/folder to resume from
    ckpt_path: str | None = None
    checkpoint_every_n_steps: int = 200
    # step checkpoints kept: the newest K (-1: all) and every one at a multiple of M;
    # never the newest (see recipes_lib.checkpoint.retention)
    keep_last_checkpoints: int = 2
    keep_every_n_steps: int | None = None
    # ModelCheckpoint's own pruning: -1 writes every step checkpoint (the two keys above
    # decide which stay), 0 writes none (last.ckpt only); 1 (deprecated) keeps one
    save_top_k: int = -1
    # code of your own a run may build from config (a module path ending in '.', or one
    # exact target), e.g. [mypkg.callbacks.]; set only on the command line (or with
    # RECIPES_ALLOWED_TARGETS), never in a recipe: recipes_lib.config.widening
    allowed_targets: list[str] = field(default_factory=list)
    # run the pre-launch check (recipes_lib.launch_check) instead of training: recipes-train
    # prints its table and exits, non-zero on a problem (the same as recipes-check)
    launch_check: bool = False
    # GiB of device memory the run must fit (kernels.activation_checkpointing=auto picks
    # for it); null: the card's own memory
    memory_budget_gib: float | None = None


@dataclass
class RunConfig:
    """The root of one stage run's configuration."""

    model: ModelConfig = field(default_factory=ModelConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    stage: StageConfig = field(default_factory=StageConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    run: RunInfoConfig = field(default_factory=RunInfoConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    callbacks: dict[str, Any] = field(default_factory=dict)  # name -> {_target_: ...}
    logger: dict[str, Any] = field(default_factory=dict)  # name -> {_target_: ...}

"""The config of one RL run (``moerl train``): its sections, their range checks (run when the config is built, so a
bad value is refused before any rollout), and which fields a ``--resume`` may change."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from moerl.config import config_key, finite, quoted, require
from moerl.device import device_name
from moerl.envs import check_env_kwargs, env_class
from moerl.envs.rewards import reward_fns
from moerl.envs.user import load_code
from moerl.errors import ConfigError
from moerl.modes import mode_of
from moerl.precision import DTYPE_NAMES
from moerl.presets import PRESETS
from moerl.trainer import PolicyConfig
from moerl.trainer.advantages import ESTIMATORS
from moerl.trainer.compile import check as check_compile
from moerl.trainer.losses import PolicyLossConfig

ENGINES = ("native", "vllm")


def _count(x) -> bool:
    """A resource amount: a finite number >= 0."""
    return finite(x) and x >= 0


@dataclass(slots=True)
class ModelSection:
    # the checkpoint to train: a directory or a Hugging Face hub id (owner/name, from the HF cache, offline first);
    # null: a random model of arch / preset
    path: str | None = None
    revision: str | None = None  # with a hub id in model.path: its branch, tag or commit (default: main)
    arch: str = "qwen3_moe"  # the random model's architecture (model.path unset)
    preset: Literal[tuple(PRESETS)] = "tiny"  # the random model's size: tiny | small
    seed: int = 0  # the random model's initialisation seed
    # > 0 (model.path unset): first teach the random model the environment's worked examples for this many supervised
    # steps, so RL starts from a model that solves some problems; built once into base_cache, reused by later runs
    sft_steps: int = 0
    base_cache: str = "runs/bases"  # where warmed-up random models are kept (model.sft_steps)

    def __post_init__(self) -> None:
        require(
            "config key 'model.{}'",
            (
                ("preset", self.preset, self.preset in PRESETS, f"allowed: {', '.join(PRESETS)}"),
                ("sft_steps", self.sft_steps, isinstance(self.sft_steps, int) and self.sft_steps >= 0, "must be >= 0"),
                (
                    "sft_steps",
                    self.sft_steps,
                    not self.sft_steps or self.path is None,
                    "warms up the random model of model.arch / model.preset: with model.path set it would be ignored "
                    "(remove one of them)",
                ),
            ),
        )


PLACEMENTS = ("inprocess", "process")  # what rollout.placement chooses; "ray": Ray actors (cluster.backend=ray)


@dataclass(slots=True)
class RolloutSection:
    engine: Literal[ENGINES] = "native"  # native (moerl's engine) | vllm
    prompts_per_step: int = 16  # problems per RL step (groups)
    group_size: int = 8  # samples per problem (the group a GRPO / RLOO baseline is taken over)
    max_tokens: int = 8  # tokens per completion (per turn in multi-turn environments)
    temperature: float = 1.0  # sampling temperature of the rollouts (evaluation is greedy)
    top_p: float = 1.0  # nucleus sampling of the rollouts
    max_model_len: int = 128  # context window of a sequence: prompt and completion(s)
    max_num_seqs: int = 128  # sequences an engine decodes at once (sizes its KV cache)
    # native engines: inprocess | process (vLLM ones always run in their own)
    placement: Literal[PLACEMENTS] = "inprocess"
    num_engines: int = 1  # the groups of a step are split across them
    engine_threads: int = 0  # torch threads per engine process (0: this process's threads / num_engines)
    # weight sync goes in buckets of at most this many MiB; a sharded trainer's weights split by rows travel in parts
    # of at most a bucket (fewer, larger transfers run nearer a link's bandwidth; each is a few fp32 copies of its
    # bytes on the rank that makes it)
    sync_bucket_mb: int = 256
    # how weights reach engines in other processes: auto (CUDA IPC between GPUs of one node, else shared memory;
    # bytes through Ray between nodes) | shm | inline (in the message) | cuda_ipc | broadcast (NCCL / gloo group)
    weight_transport: Literal[TRANSPORTS] = "auto"
    engine_timeout_s: float = 300.0  # an engine in another process that makes no progress this long is named, the
    # run stops with its state saved (progress: a decode step or a reply; heartbeats show a busy engine lives)
    vllm_args: dict = field(default_factory=dict)  # more vllm.LLM arguments (engine=vllm), e.g. enforce_eager: true
    # engine compute dtype: auto (native engines: bf16 where native, else fp32; vLLM: bf16)
    dtype: Literal[DTYPE_NAMES] = "auto"
    device: str = "auto"  # native engines: auto (CUDA where present) | cpu | cuda | cuda:N; vLLM picks its own
    # native engines: decode steps through one torch.compile graph (every mode); auto: compiled once the run's first
    # steps show the steps left repay the compilation (synchronous runs; moerl.engine.compiled.pays), kept only if
    # the next two steps decode faster than eager did (moerl.hooks.AutoTune)
    compile_decode: bool | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        require(
            "config key 'rollout.{}'",
            (
                ("engine", self.engine, self.engine in ENGINES, f"allowed: {', '.join(ENGINES)}"),
                ("placement", self.placement, self.placement in PLACEMENTS, f"allowed: {', '.join(PLACEMENTS)}"),
                ("num_engines", self.num_engines, self.num_engines >= 1, "must be >= 1"),
                ("engine_threads", self.engine_threads, self.engine_threads >= 0, "must be >= 0 (0: automatic)"),
                ("sync_bucket_mb", self.sync_bucket_mb, self.sync_bucket_mb >= 1, "must be >= 1"),
                (
                    "engine_timeout_s",
                    self.engine_timeout_s,
                    finite(self.engine_timeout_s) and self.engine_timeout_s > 0,
                    "must be > 0 (seconds)",
                ),
                (
                    "weight_transport",
                    self.weight_transport,
                    self.weight_transport in TRANSPORTS,
                    f"allowed: {', '.join(TRANSPORTS)}",
                ),
                (
                    "weight_transport",
                    self.weight_transport,
                    self.weight_transport == "auto" or self.engine == "native",
                    "native engines only (vLLM engines take their weights in their own processes): leave it auto",
                ),
                ("vllm_args", self.vllm_args, not self.vllm_args or self.engine == "vllm", "only with engine: vllm"),
                ("dtype", self.dtype, self.dtype in DTYPE_NAMES, f"allowed: {', '.join(DTYPE_NAMES)}"),
                (
                    "device",
                    self.device,
                    device_name(self.device, "rollout.device") == "auto" or self.engine == "native",
                    "native engines only (vLLM places itself on its platform's devices): leave it auto",
                ),
                (
                    "compile_decode",
                    self.compile_decode,
                    isinstance(self.compile_decode, bool) or self.compile_decode == "auto",
                    f"allowed: auto, true, false{quoted(self.compile_decode)}",
                ),
                (
                    "compile_decode",
                    self.compile_decode,
                    self.compile_decode is not True or self.engine == "native",
                    "only with engine: native (vLLM compiles its own graphs)",
                ),
                ("prompts_per_step", self.prompts_per_step, self.prompts_per_step >= 1, "must be >= 1"),
                ("group_size", self.group_size, self.group_size >= 1, "must be >= 1"),
                ("max_tokens", self.max_tokens, self.max_tokens >= 1, "must be >= 1"),
                ("temperature", self.temperature, finite(self.temperature) and self.temperature >= 0, "must be >= 0"),
                ("top_p", self.top_p, finite(self.top_p) and 0 < self.top_p <= 1, "must lie in (0, 1]"),
                ("max_model_len", self.max_model_len, self.max_model_len >= 2, "must be >= 2"),
                ("max_num_seqs", self.max_num_seqs, self.max_num_seqs >= 1, "must be >= 1"),
            ),
        )

    def check_placement(self, backend: str) -> None:
        """Where the engines run against how they take their weights, for ``cluster.backend`` ``backend``."""
        if backend == "ray" and self.placement != "inprocess":
            raise ConfigError(
                f"rollout.placement={self.placement!r} with cluster.backend: ray: the engines are Ray actors "
                "(cluster.placement says where)"
            )
        if self.weight_transport != "auto" and self.placement == "inprocess" and backend == "local":
            raise ConfigError(
                f"config key 'rollout.weight_transport'={self.weight_transport!r} with rollout.placement=inprocess: "
                "engines in the trainer's process take its tensors as they are (leave it auto)"
            )


@dataclass(slots=True)
class AlgoSection:
    advantage: Literal[tuple(ESTIMATORS)] = "grpo"  # grpo | rloo | reinforce_pp
    std_normalize: bool = True  # grpo: divide by the group's reward std
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    ppo_epochs: int = 1  # passes over a step's samples
    mini_batches: int = 1  # optimizer steps per pass (the samples split into this many)
    r3: bool = True  # replay the engine's routing in the old-logprob and training forwards
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, refill with new prompts
    max_refills: int = 3  # dynamic sampling: rounds of new prompts per step at most
    overlong_filter: bool = False  # DAPO: sequences cut by max_tokens do not enter the loss
    reward_timeout_s: float = 5.0  # seconds a reward (or a multi-turn env's step) may take; then it scores 0
    mismatch_metric_every: int = 10  # the R3-off mismatch metric (a forward of its own) every N steps (0: never)
    async_: bool = False  # key `algo.async`: generate the next steps' rollouts while this one trains
    max_staleness: int = 1  # async: no sample more than this many weight versions behind the trainer

    def __post_init__(self) -> None:
        t = self.reward_timeout_s
        require(
            "config key 'algo.{}'",
            (
                ("advantage", self.advantage, self.advantage in ESTIMATORS, f"allowed: {', '.join(ESTIMATORS)}"),
                ("ppo_epochs", self.ppo_epochs, self.ppo_epochs >= 1, "must be >= 1"),
                ("mini_batches", self.mini_batches, self.mini_batches >= 1, "must be >= 1"),
                ("max_refills", self.max_refills, self.max_refills >= 0, "must be >= 0"),
                ("reward_timeout_s", t, finite(t) and t > 0, "must be a positive number of seconds"),
                ("max_staleness", self.max_staleness, self.max_staleness >= 1, "must be >= 1 (versions behind)"),
                (
                    "mismatch_metric_every",
                    self.mismatch_metric_every,
                    self.mismatch_metric_every >= 0,
                    "must be >= 0 (0: never)",
                ),
            ),
        )


@dataclass(slots=True)
class RewardSection:
    # the reward function: file.py:name or package.module:name, called as fn(completion, **fields) with the problem's
    # other fields (a dataset record's fields besides its prompt); returns a number
    fn: str = ""
    weight: float = 1.0  # its weight in the sum


@dataclass(slots=True)
class ChatSection:
    # render prompts with the tokenizer's own chat template (text as one user message, or a record's list of
    # messages), the template's end-of-turn token ending the model's turn; a multi-turn environment's turns too
    template: bool = False
    system: str | None = None  # a system message put first where a prompt has none
    kwargs: dict = field(default_factory=dict)  # the template's own arguments, e.g. {enable_thinking: false}


@dataclass(slots=True)
class EnvSection:
    # a built-in (arithmetic | countdown | math | calculator | dataset | reasoning_gym | verifiers), your class by path
    # (my_tasks.py:MyEnv or package.module:MyEnv), or a name an installed package registers (entry points moerl.envs)
    name: str = "arithmetic"
    kwargs: dict = field(default_factory=dict)  # the environment's arguments, e.g. {max_operand: 19, ops: "+"}
    # reward functions scoring single-turn completions in place of the environment's own reward, summed by weight:
    # [{fn: my_rewards.py:correct, weight: 1.0}, {fn: my_rewards.py:brief, weight: 0.2}]
    rewards: list[RewardSection] = field(default_factory=list)
    # [open, close] of a reasoning block, e.g. ["<think>", "</think>"]: rewards (and environment steps) see the
    # completion without it, the answer after it
    reasoning_tags: list[str] = field(default_factory=list)
    chat: ChatSection = field(default_factory=ChatSection)
    eval_problems: int = 64  # distinct held-out problems evaluated greedily (0: no evaluation)

    def __post_init__(self) -> None:
        tags = self.reasoning_tags
        require(
            "config key 'env.{}'",
            (
                ("eval_problems", self.eval_problems, self.eval_problems >= 0, "must be >= 0"),
                (
                    "reasoning_tags",
                    tags,
                    not tags or (len(tags) == 2 and all(isinstance(t, str) and t for t in tags)),
                    "must be [open, close], two non-empty strings (or [] for none)",
                ),
            ),
        )
        self.kwargs = check_env_kwargs(self.name, self.kwargs)
        cls = env_class(self.name)
        multi_turn = hasattr(cls, "start") or hasattr(cls, "run_episodes")  # the environment scores its episodes
        if self.rewards and multi_turn:
            raise ConfigError(
                f"config key 'env.rewards': environment {self.name!r} scores its own episodes (a multi-turn one's "
                "step, a verifiers one's rewards); env.rewards scores single-turn completions"
            )
        if hasattr(cls, "run_episodes"):  # its agents' prompts and its rewards are the environment's own
            for key, value in (("reasoning_tags", self.reasoning_tags), ("chat.system", self.chat.system)):
                if value:
                    raise ConfigError(
                        f"config key 'env.{key}'={value!r}: environment {self.name!r} runs agents that bring their own "
                        "prompts and rewards; leave it out"
                    )
        reward_fns(self.rewards, load_code)  # each loads and is a function with a finite weight
        if not self.rewards and not multi_turn and isinstance(cls, type) and not hasattr(cls, "reward"):
            raise ConfigError(
                f"config key 'env.rewards': environment {self.name!r} has no reward of its own; name reward "
                "functions here ([{fn: my_rewards.py:correct, weight: 1.0}, ...])"
            )


@dataclass(slots=True)
class TrainSection:
    steps: int = 50  # RL steps
    seed: int = 0  # the run's seed: problems, sampling, adapter init; and which held-out problems
    checkpoint_every: int = 10  # save the state every N steps (0: at the end only); --resume goes on from it
    eval_every: int = 0  # 0: evaluate before and after only
    export_adapter: bool = True  # lora: write a PEFT adapter at the end
    # SIGTERM / SIGUSR1 (a scheduler's preemption): save after the step in progress, then exit 143; if the save is
    # not done this many seconds after the signal, stop anyway (the last complete checkpoint is kept)
    preempt_grace_s: float = 90.0
    # deterministic algorithms (torch.use_deterministic_algorithms; cuBLAS's fixed workspace): what bit-exact
    # reruns and resumes on CUDA need (its index_add_ and some reductions use atomics); the CPU ones are already
    deterministic: bool = False

    def __post_init__(self) -> None:
        require(
            "config key 'train.{}'",
            (
                ("steps", self.steps, self.steps >= 1, "must be >= 1"),
                ("deterministic", self.deterministic, isinstance(self.deterministic, bool), "must be true or false"),
                ("checkpoint_every", self.checkpoint_every, self.checkpoint_every >= 0, "must be >= 0 (0: at the end)"),
                ("eval_every", self.eval_every, self.eval_every >= 0, "must be >= 0 (0: before and after only)"),
                (
                    "preempt_grace_s",
                    self.preempt_grace_s,
                    finite(self.preempt_grace_s) and self.preempt_grace_s > 0,
                    "must be > 0 (seconds)",
                ),
            ),
        )


SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")


@dataclass(slots=True)
class ParallelSection:
    """How the trainer is split across ranks: dp (FSDP2 data parallel) x ep (experts) x pp (pipeline stages) x cp
    (context parallel: each sequence's tokens)."""

    dp: int = 1  # data-parallel ranks (FSDP2)
    ep: int = 1  # expert-parallel ranks (the experts split across them)
    pp: int = 1  # pipeline stages
    cp: int = 1  # context-parallel ranks: each sequence's tokens split over them (attention by all-to-all over heads)
    microbatches: int = 0  # pipeline micro-batches per call (0: one per stage, more if policy.micro_batch_size needs)
    schedule: Literal[SCHEDULES] = "1f1b"  # pipeline schedule: 1f1b | gpipe | interleaved_1f1b (two stages per rank)
    stages: list[int] = field(default_factory=list)  # layers per pipeline stage ([]: balanced by parameter count)
    # how long a collective waits for the other ranks before the run stops naming the one that stopped answering;
    # ranks wait in one while rank 0 generates and evaluates, so it must exceed that phase
    timeout_s: float = 1800.0

    @property
    def size(self) -> int:
        return self.dp * self.ep * self.pp * self.cp

    def __post_init__(self) -> None:
        require(
            "config key 'parallel.{}'",
            (
                ("dp", self.dp, isinstance(self.dp, int) and self.dp >= 1, "must be >= 1"),
                # not built yet: refused rather than ignored
                ("ep", self.ep, isinstance(self.ep, int) and self.ep >= 1, "must be >= 1"),
                ("pp", self.pp, isinstance(self.pp, int) and self.pp >= 1, "must be >= 1"),
                ("cp", self.cp, isinstance(self.cp, int) and self.cp >= 1, "must be >= 1"),
                ("microbatches", self.microbatches, self.microbatches >= 0, "must be >= 0 (0: one per stage)"),
                ("schedule", self.schedule, self.schedule in SCHEDULES, f"allowed: {', '.join(SCHEDULES)}"),
                ("timeout_s", self.timeout_s, finite(self.timeout_s) and self.timeout_s > 0, "must be > 0 (seconds)"),
            ),
        )


TRANSPORTS = ("auto", "shm", "inline", "cuda_ipc", "broadcast")  # moerl.rollout.transport
BACKENDS = ("local", "ray")
CLUSTER_PLACEMENTS = ("disaggregated", "colocated")


WANDB_MODES = ("online", "offline", "disabled")


@dataclass(slots=True)
class WandbSection:
    project: str = ""  # Weights & Biases project to log the run's metrics and config to ("": off; needs moerl[wandb])
    entity: str | None = None  # the W&B team or user (null: your default)
    mode: Literal[WANDB_MODES] = "online"  # online | offline (files in run_dir/wandb, `wandb sync` later) | disabled

    def __post_init__(self) -> None:
        require(
            "config key 'metrics.wandb.{}'",
            (("mode", self.mode, self.mode in WANDB_MODES, f"allowed: {', '.join(WANDB_MODES)}"),),
        )


@dataclass(slots=True)
class MetricsSection:
    # TensorBoard scalars in run_dir/tensorboard. auto: where tensorboard is installed (said once where it is not);
    # true: a run where it is not installed is refused before it starts; false: metrics.jsonl (and W&B) only
    tensorboard: bool | Literal["auto"] = "auto"
    # the run's curves as run_dir/curves.png at its end (matplotlib), with the same auto / true / false
    plot: bool | Literal["auto"] = "auto"
    wandb: WandbSection = field(default_factory=WandbSection)

    def __post_init__(self) -> None:
        require(
            "config key 'metrics.{}'",
            (
                (name, value, isinstance(value, bool) or value == "auto", f"allowed: auto, true, false{quoted(value)}")
                for name, value in (("tensorboard", self.tensorboard), ("plot", self.plot))
            ),
        )


@dataclass(slots=True)
class ClusterSection:
    """Where the run's processes go: this machine (``local``: the trainer here or under torchrun, engines per
    ``rollout.placement``), or Ray actors in a placement group (``ray``)."""

    backend: Literal[BACKENDS] = "local"  # local | ray
    address: str = ""  # ray: "" starts a local Ray cluster for the run; "auto" or "host:port" joins a running one
    # ray: engines on CPUs of their own | colocated: each shares a trainer rank's CPUs and GPU
    placement: Literal[CLUSTER_PLACEMENTS] = "disaggregated"
    cpus_per_trainer: int = 1  # ray: CPUs (and torch threads) of each trainer rank
    cpus_per_engine: int = 1  # ray, disaggregated: CPUs (and torch threads) of each engine
    gpus_per_trainer: float = 0  # ray: GPUs of each trainer rank (1: one process per GPU; colocated engines share it)
    gpus_per_engine: float = 0  # ray, disaggregated: GPUs of each engine (a fraction shares a GPU between engines)
    engine_restarts: int = 3  # ray: how often Ray restarts an engine actor that dies (the pool brings it back)
    runtime_env: dict = field(default_factory=dict)  # ray: Ray's runtime_env for the run (env_vars, py_modules, ...)

    def __post_init__(self) -> None:
        require(
            "config key 'cluster.{}'",
            (
                ("backend", self.backend, self.backend in BACKENDS, f"allowed: {', '.join(BACKENDS)}"),
                ("placement", self.placement, self.placement in CLUSTER_PLACEMENTS,
                 f"allowed: {', '.join(CLUSTER_PLACEMENTS)}"),
                ("cpus_per_trainer", self.cpus_per_trainer, self.cpus_per_trainer >= 1, "must be >= 1"),
                ("cpus_per_engine", self.cpus_per_engine, self.cpus_per_engine >= 1, "must be >= 1"),
                ("gpus_per_trainer", self.gpus_per_trainer, _count(self.gpus_per_trainer), "must be >= 0 (0: no GPU)"),
                ("gpus_per_engine", self.gpus_per_engine, _count(self.gpus_per_engine), "must be >= 0 (0: no GPU)"),
                ("engine_restarts", self.engine_restarts, self.engine_restarts >= 0, "must be >= 0"),
            ),
        )  # fmt: skip
        if self.backend == "local":  # Ray's settings would be ignored: refused instead
            default = ClusterSection(backend="ray")
            for f in dataclasses.fields(self):
                if f.name != "backend" and getattr(self, f.name) != getattr(default, f.name):
                    raise ConfigError(f"config key 'cluster.{f.name}' is only used with cluster.backend: ray")


@dataclass(slots=True)
class RunConfig:
    run_dir: str = "runs/run"  # where the run writes its config, metrics, checkpoint, adapter and curves
    model: ModelSection = field(default_factory=ModelSection)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    algo: AlgoSection = field(default_factory=AlgoSection)
    env: EnvSection = field(default_factory=EnvSection)
    train: TrainSection = field(default_factory=TrainSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)

    def __post_init__(self) -> None:
        r, a = self.rollout, self.algo
        r.check_placement(self.cluster.backend)
        if self.env.chat.template and self.model.path is None:
            raise ConfigError(
                "config key 'env.chat.template'=true: the random model (model.path unset) has moerl's character "
                "tokenizer, which has no chat template; set model.path to a checkpoint whose tokenizer has one"
            )
        mode = mode_of(self.policy.mode)
        check_compile(self.policy.compile, self.parallel.size, mode)
        mode.check_run(r.engine, self.parallel.size)
        if r.weight_transport == "broadcast" and self.cluster.backend == "ray" and self.cluster.engine_restarts:
            raise ConfigError(
                "config key 'rollout.weight_transport'='broadcast' with cluster.engine_restarts="
                f"{self.cluster.engine_restarts}: a restarted engine cannot rejoin the broadcast group; set "
                "cluster.engine_restarts: 0 or use another transport"
            )
        batch = r.prompts_per_step * r.group_size
        if a.mini_batches > batch:
            raise ConfigError(
                f"config key 'algo.mini_batches'={a.mini_batches}: must be <= the batch of "
                f"rollout.prompts_per_step x rollout.group_size = {batch} sequences"
            )
        if r.group_size < 2 and a.advantage in ("grpo", "rloo"):
            raise ConfigError(
                f"config key 'rollout.group_size'=1 with algo.advantage={a.advantage!r}: a group baseline of one "
                "sample makes every advantage 0 (no learning signal); use group_size >= 2 or reinforce_pp"
            )
        if self.policy.max_tokens_per_micro_batch is None:  # the default: the context window where longer
            # a rank's: with context parallelism it holds its share of the longest sequence
            longest = -(-r.max_model_len // self.parallel.cp)
            self.policy.max_tokens_per_micro_batch = max(self.policy.token_budget, longest)
        budget, cp = self.policy.max_tokens_per_micro_batch, self.parallel.cp
        if budget and budget * cp < r.max_model_len:
            split = f" split over parallel.cp={cp} ranks" if cp > 1 else ""
            raise ConfigError(
                f"config key 'policy.max_tokens_per_micro_batch'={budget}: a sequence may hold rollout.max_model_len="
                f"{r.max_model_len} tokens, more than a micro-batch may{split} (the budget is a rank's); raise it, "
                "raise parallel.cp (a sequence's tokens split over ranks), or lower rollout.max_model_len"
            )
        if self.policy.optimizer_in_backward:
            self._check_in_backward(-(-batch // a.mini_batches))

    def _check_in_backward(self, rows: int) -> None:
        """``policy.optimizer_in_backward`` steps each tensor in the backward of a step's only micro-batch, in one
        process: a mini-batch of ``rows`` sequences at their longest must be one micro-batch."""
        p, longest = self.policy, self.rollout.max_model_len
        if self.parallel.size > 1:
            raise ConfigError(
                f"config key 'policy.optimizer_in_backward'=true with parallel.* making {self.parallel.size} ranks: "
                "not built (gradients reduced over ranks after the backward); set it to false, or train in one process"
            )
        size, budget = p.micro_batch_size, p.max_tokens_per_micro_batch
        if (size and size < rows) or (budget and budget < rows * longest):
            raise ConfigError(
                f"config key 'policy.optimizer_in_backward'=true: a step's {rows} sequences (rollout.prompts_per_step"
                f" x rollout.group_size / algo.mini_batches) of up to rollout.max_model_len={longest} tokens would "
                f"split into micro-batches under policy.micro_batch_size={size} and policy.max_tokens_per_micro_batch="
                f"{budget}, and each tensor steps in the backward of one; set policy.max_tokens_per_micro_batch >= "
                f"{rows * longest} and policy.micro_batch_size 0 or >= {rows}, or optimizer_in_backward: false"
            )


# Fields a resumed run may change (applied from the resume on, and recorded with the step): how long, how fast,
# how often, and how much memory. Everything else defines the run and is refused.
MUTABLE = (
    "run_dir",
    "train.steps",
    "train.checkpoint_every",
    "train.eval_every",
    "train.export_adapter",
    "train.preempt_grace_s",
    "policy.optim.lr",
    "policy.optim.weight_decay",
    "policy.optim.grad_clip",
    "policy.optim.total_steps",
    "policy.optim.min_lr_ratio",
    "policy.micro_batch_size",
    "policy.max_tokens_per_micro_batch",  # how a step's samples split: its loss is the same (normalised by the batch)
    "policy.logits_chunk",  # chunked and whole logits compute the same logprobs to fp32 rounding
    "policy.activation_checkpointing",  # a recomputed block replays its forward's experts: the same step
    "policy.optimizer_in_backward",  # each tensor's AdamW step, taken as its gradient comes: the same step
    "policy.max_nan_steps",
    "policy.compile",  # compiled and eager blocks compute the same step to fp32 rounding (tests/test_trainer_compile)
    "policy.device",  # a checkpoint's tensors are on no device: a run may move between CPU and GPU (dtype auto
    "rollout.device",  # follows the device)
    "rollout.max_num_seqs",
    "rollout.placement",
    "rollout.num_engines",
    "rollout.engine_threads",
    "rollout.sync_bucket_mb",
    "rollout.weight_transport",
    "rollout.engine_timeout_s",
    "rollout.compile_decode",
    "parallel.dp",  # a checkpoint holds whole tensors: any dp or ep size loads it
    "parallel.ep",
    "parallel.pp",
    "parallel.cp",
    "parallel.schedule",
    "parallel.microbatches",
    "parallel.stages",
    "parallel.timeout_s",
    "env.eval_problems",
    "algo.reward_timeout_s",
    "algo.mismatch_metric_every",
    "cluster.backend",  # where processes run does not change what the run computes
    "cluster.address",
    "cluster.placement",
    "cluster.cpus_per_trainer",
    "cluster.cpus_per_engine",
    "cluster.engine_restarts",
    "cluster.runtime_env",
    "metrics.tensorboard",  # where the metrics go does not change them
    "metrics.plot",
    "metrics.wandb.project",
    "metrics.wandb.entity",
    "metrics.wandb.mode",
)


def flatten(obj, prefix: str = "") -> dict:
    """Dotted key -> value for every leaf field of a (nested) config dataclass; dict fields stay whole values."""
    out = {}
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), config_key(f.name)
        if dataclasses.is_dataclass(value):
            out |= flatten(value, prefix + key + ".")
        else:
            out[prefix + key] = value
    return out

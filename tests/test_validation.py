"""Validation of whole configurations: every error path, derived defaults, and the example YAML files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from meshtron import validation
from meshtron.cli import build_config
from meshtron.config import ConfigError, MeshtronConfig
from meshtron.validation import data_parallel_size, parse_data_path, parse_split, validate_config

REPO = Path(__file__).resolve().parents[1]
SHAPE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"]  # a small non-preset model


def validated(argv: list[str], world_size: int = 1) -> MeshtronConfig:
    cfg = build_config(argv)
    validate_config(cfg, world_size)
    return cfg


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend CUDA is available (only the config is checked; nothing runs on a GPU)."""
    monkeypatch.setattr(validation, "_cuda_available", lambda: True)


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(validation, "_cuda_available", lambda: False)


# (argv, world size, a fragment of the expected message). Every message must name the flag and the numbers.
ERRORS = [
    (["--tensor-model-parallel-size", "4"], 6, "world size 6 is not divisible by TP(4) x CP(1) x PP(1) = 4"),
    (["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2"], 6,
     "world size 6 is not divisible by TP(1) x CP(2) x PP(2) = 4"),
    (["--tensor-model-parallel-size", "0"], 1, "--tensor-model-parallel-size must be positive, got 0"),
    (SHAPE + ["--num-attention-heads", "6", "--hidden-size", "96", "--tensor-model-parallel-size", "4"], 4,
     "--num-attention-heads (6) must be divisible by --tensor-model-parallel-size (4)"),
    (SHAPE + ["--num-attention-heads", "12", "--hidden-size", "96", "--group-query-attention",
              "--num-query-groups", "6", "--tensor-model-parallel-size", "4"], 4,
     "--num-query-groups (6) must be divisible by --tensor-model-parallel-size (4)"),
    (SHAPE + ["--group-query-attention", "--num-query-groups", "3"], 1,
     "--num-attention-heads (4) must be divisible by --num-query-groups (3)"),
    (SHAPE + ["--num-query-groups", "2"], 1, "--num-query-groups 2 needs --group-query-attention"),
    (SHAPE + ["--hidden-size", "66"], 1, "--hidden-size (66) must be divisible by --num-attention-heads (4)"),
    (SHAPE + ["--ffn-hidden-size", "250", "--tensor-model-parallel-size", "4"], 4,
     "--ffn-hidden-size (250) must be divisible by --tensor-model-parallel-size (4)"),
    (SHAPE + ["--seq-length", "100", "--context-parallel-size", "4"], 4,
     "--seq-length (100) must be divisible by 2 x --context-parallel-size (4) = 8"),
    (SHAPE + ["--seq-length", "30", "--tensor-model-parallel-size", "4", "--sequence-parallel"], 4,
     "--seq-length (30) must be divisible by --tensor-model-parallel-size (4) with --sequence-parallel"),
    (SHAPE + ["--sequence-parallel"], 1, "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    (SHAPE + ["--num-layers", "6", "--pipeline-model-parallel-size", "4"], 4,
     "--num-layers (6) must be divisible by --pipeline-model-parallel-size (4)"),
    (SHAPE + ["--num-layers", "8", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
              "3"], 2, "layers per pipeline stage (4, from --num-layers 8 and --pipeline-model-parallel-size 2) must "
                       "be divisible by --num-layers-per-virtual-pipeline-stage (3)"),
    (SHAPE + ["--num-layers", "8", "--pipeline-model-parallel-size", "2", "--account-for-loss-in-pipeline-split"], 2,
     "plus the 1 layer slot(s) of --account-for-loss-in-pipeline-split = 9 must be divisible"),
    (SHAPE + ["--num-layers", "6", "--pipeline-model-parallel-size", "2", "--decoder-last-pipeline-num-layers", "2",
              "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"], 2,
     "cannot be combined with --decoder-first-pipeline-num-layers"),
    (SHAPE + ["--num-layers", "6", "--pipeline-model-parallel-size", "2", "--mtp-num-layers", "1",
              "--pipeline-model-parallel-layout", "Ett|tt|ttm|L"], 2,
     "meshtron computes them beside the loss, in the last model chunk: --pipeline-model-parallel-layout "
     "'Ett|tt|tt|mL' keeps every other chunk as it is"),
    (SHAPE + ["--num-layers", "6", "--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout",
              "Ett|t|t|ttL", "--virtual-pipeline-model-parallel-size", "3"], 2,
     "names 4 model chunks, 2 per pipeline stage, but --virtual-pipeline-model-parallel-size is 3"),
    # Megatron-LM flags that meshtron parses in order to say why it does not do what they ask.
    (SHAPE + ["--recompute-activations", "--recompute-granularity", "full"], 1,
     "--recompute-activations means --recompute-granularity selective; it contradicts"),
    (SHAPE + ["--fp8-amax-history-len", "1024"], 1, "--fp8-amax-history-len configures delayed FP8 scaling"),
    (SHAPE + ["--use-torch-fsdp2", "--data-parallel-sharding-strategy", "optim"], 1,
     "--use-torch-fsdp2 means --data-parallel-sharding-strategy optim_grads_params, which contradicts"),
    (SHAPE + ["--data-parallel-sharding-strategy", "no_shard", "--use-distributed-optimizer"], 1,
     "--use-distributed-optimizer shards the optimizer state, which contradicts"),
    (SHAPE + ["--data-parallel-sharding-strategy", "optim_grads_params", "--overlap-param-gather"], 1,
     "with optim_grads_params each layer's gather is always prefetched"),
    (SHAPE + ["--rampup-batch-size", "32", "32", "1000"], 1, "--rampup-batch-size is not supported"),
    (SHAPE + ["--manual-gc-interval", "5"], 1, "--manual-gc-interval needs --manual-gc"),
    (SHAPE + ["--loss-scale", "1024"], 1, "--loss-scale belongs to fp16 training"),
    (SHAPE + ["--no-position-embedding", "--position-embedding-type", "learned_absolute"], 1,
     "--no-position-embedding leaves the model without positions"),
    (SHAPE + ["--profile", "--profile-ranks", "0", "x"], 1, "--profile-ranks takes global rank numbers, got 0 x"),
    (SHAPE + ["--record-memory-history", "--device", "cpu"], 1, "--record-memory-history records the CUDA allocator"),
    (SHAPE + ["--num-experts", "4", "--moe-router-topk-scaling-factor", "0"], 1,
     "--moe-router-topk-scaling-factor must be positive"),
    (SHAPE + ["--num-experts", "8", "--moe-router-num-groups", "4"], 1,
     "--moe-router-num-groups and --moe-router-group-topk go together"),
    (SHAPE + ["--num-experts", "8", "--moe-router-num-groups", "3", "--moe-router-group-topk", "1"], 1,
     "--moe-router-num-groups (3) must divide --num-experts (8)"),
    (SHAPE + ["--num-experts", "8", "--moe-router-topk", "6", "--moe-router-num-groups", "4",
              "--moe-router-group-topk", "2"], 1, "at most the 4 experts of the chosen groups"),
    (SHAPE + ["--moe-token-dispatcher-type", "allgather"], 1, "valid: alltoall"),
    (SHAPE + ["--num-experts", "4", "--moe-pad-expert-input-to-capacity"], 1,
     "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"),
    (SHAPE + ["--num-layers-per-virtual-pipeline-stage", "2"], 1,
     "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1"),
    (SHAPE + ["--num-layers", "8", "--pipeline-model-parallel-size", "3", "--decoder-first-pipeline-num-layers", "3"],
     3, "--num-layers (8) minus --decoder-first-pipeline-num-layers 3 leaves 5 layers"),
    (SHAPE + ["--num-layers", "8", "--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "3",
              "--decoder-last-pipeline-num-layers", "4"], 2, "must add up to --num-layers (8)"),
    (SHAPE + ["--num-layers", "9", "--pipeline-model-parallel-size", "3", "--decoder-last-pipeline-num-layers", "3",
              "--virtual-pipeline-model-parallel-size", "2"], 3,
     "pipeline stage 0 has 3 layers, not divisible by 2 virtual stages (--virtual-pipeline-model-parallel-size"),
    (SHAPE + ["--num-experts", "6", "--expert-model-parallel-size", "4"], 4,
     "--num-experts (6) must be divisible by --expert-model-parallel-size (4)"),
    (SHAPE + ["--num-experts", "8", "--expert-model-parallel-size", "4"], 2,
     "--expert-model-parallel-size (4) must divide data-parallel size (2) x --context-parallel-size (1) = 2"),
    (SHAPE + ["--expert-model-parallel-size", "2"], 2, "--expert-model-parallel-size 2 needs a mixture-of-experts"),
    (SHAPE + ["--num-experts", "4", "--moe-router-topk", "5"], 1, "--moe-router-topk must be in [1, --num-experts (4)]"),
    (SHAPE + ["--micro-batch-size", "4", "--global-batch-size", "12"], 2,
     "--global-batch-size (12) must be divisible by --micro-batch-size (4) x data-parallel size (2) = 8"),
    (SHAPE + ["--micro-batch-size", "0"], 1, "--micro-batch-size must be positive, got 0"),
    (SHAPE + ["--fp16"], 1, "--fp16 is not supported: use --bf16"),
    (SHAPE + ["--bf16", "--fp32"], 1, "--bf16 and --fp32 exclude each other"),
    (SHAPE + ["--device", "cpu", "--fp8-format", "e4m3"], 1, "--fp8-format e4m3 needs --bf16"),
    (SHAPE + ["--device", "cpu", "--fp8-hybrid"], 1, "--fp8-format hybrid needs --bf16"),
    (SHAPE + ["--bf16", "--fp8-hybrid", "--fp8-recipe", "delayed"], 1, "--fp8-recipe delayed is not implemented"),
    (SHAPE + ["--num-layers", "0"], 1, "--num-layers must be positive, got 0"),
    (SHAPE + ["--hidden-size", "-64"], 1, "--hidden-size must be positive, got -64"),
    (SHAPE + ["--seq-length", "0"], 1, "--seq-length must be positive, got 0"),
    (SHAPE + ["--vocab-size", "0"], 1, "--vocab-size must be positive, got 0"),
    (SHAPE + ["--lr", "1e-4", "--min-lr", "1e-3"], 1, "--lr (0.0001) must be at least --min-lr (0.001)"),
    (SHAPE + ["--lr", "-1"], 1, "--lr must be >= 0, got -1.0"),
    (SHAPE + ["--lr", "1e39"], 1, "--lr must be a finite number an fp32 optimizer can hold"),
    (SHAPE + ["--train-iters", "0"], 1, "--train-iters must be positive, got 0"),
    (SHAPE + ["--hidden-dropout", "1.0"], 1, "--hidden-dropout must be in [0, 1), got 1.0"),
    (SHAPE + ["--attention-dropout", "-0.1"], 1, "--attention-dropout must be in [0, 1), got -0.1"),
    (SHAPE + ["--train-iters", "100", "--lr-warmup-iters", "100"], 1,
     "--lr-warmup-iters (100) must be smaller than --lr-decay-iters (100, default --train-iters)"),
    (SHAPE + ["--lr-warmup-iters", "10", "--lr-warmup-fraction", "0.1"], 1, "either --lr-warmup-fraction or"),
    (SHAPE + ["--adam-beta2", "1.0"], 1, "--adam-beta2 must be in [0, 1), got 1.0"),
    (SHAPE + ["--clip-grad", "-1"], 1, "--clip-grad must be >= 0"),
    (SHAPE + ["--recompute-method", "block"], 1, "--recompute-method block needs --recompute-granularity full"),
    (SHAPE + ["--recompute-granularity", "full", "--recompute-num-layers", "5"], 1,
     "--recompute-num-layers must be in [1, --num-layers (4)], got 5"),
    (SHAPE + ["--overlap-param-gather"], 1, "--overlap-param-gather needs --use-distributed-optimizer"),
    (SHAPE + ["--position-embedding-type", "learned_absolute", "--seq-length", "256",
              "--max-position-embeddings", "128"], 1, "--max-position-embeddings (128) must be at least --seq-length"),
    (SHAPE + ["--mock-data", "--data-path", "x"], 1, "--mock-data and --data-path exclude each other"),
    (SHAPE + ["--split", "90,a"], 1, "--split '90,a'"),
    (SHAPE + ["--data-path", "0.5", "A", "B"], 1, "--data-path: expected PREFIX"),
    (SHAPE + ["--tokenizer-type", "GPT2BPETokenizer"], 1, "needs --vocab-file and --merge-file"),
    (SHAPE + ["--tokenizer-type", "SentencePieceTokenizer"], 1, "--tokenizer-type SentencePieceTokenizer needs"),
    (SHAPE + ["--tokenizer-type", "NullTokenizer"], 1, "--tokenizer-type NullTokenizer needs --vocab-size"),
    (SHAPE + ["--log-interval", "0"], 1, "--log-interval must be positive, got 0"),
    (SHAPE + ["--save-interval", "0"], 1, "--save-interval must be positive, got 0"),
    (SHAPE + ["--nnodes", "2:1"], 1, "--nnodes '2:1'"),
    (SHAPE + ["--nnodes", "2", "--node-rank", "2"], 1, "--node-rank 2 must be in [0, 1] with --nnodes 2"),
    (SHAPE + ["--master-port", "70000"], 1, "--master-port must be in 1..65535"),
    (SHAPE + ["--distributed-backend", "nccl", "--device", "cpu"], 1, "--distributed-backend nccl needs --device"),
    # Megatron-LM's --position-embedding-type yarn (grouped-query attention): what megatron-core would compute
    # otherwise is refused, the flag named.
    (SHAPE + ["--position-embedding-type", "yarn", "--rotary-percent", "0.5"], 1,
     "--rotary-percent 0.5 with --position-embedding-type yarn"),
    (SHAPE + ["--position-embedding-type", "yarn", "--rope-type", "rope"], 1,
     "--rope-type rope contradicts --position-embedding-type yarn"),
    (SHAPE + ["--position-embedding-type", "yarn", "--use-rope-scaling"], 1,
     "--use-rope-scaling (Llama-3.1 frequencies) contradicts --position-embedding-type yarn"),
    (SHAPE + ["--position-embedding-type", "yarn", "--multi-latent-attention"], 1,
     "--position-embedding-type yarn is not for --multi-latent-attention"),
    (SHAPE + ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "0"], 1,
     "--rotary-scaling-factor must be positive, got 0.0"),
    (SHAPE + ["--position-embedding-type", "yarn", "--yarn-beta-slow", "-1"], 1,
     "--yarn-beta-slow must be positive, got -1.0"),
]


@pytest.mark.parametrize("argv,world_size,message", ERRORS, ids=[f"{i}-{e[2][:40]}" for i, e in enumerate(ERRORS)])
def test_validation_error(argv: list[str], world_size: int, message: str, no_cuda: None) -> None:
    with pytest.raises(ConfigError) as info:
        validated(argv, world_size)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_cuda_requested_without_cuda(no_cuda: None) -> None:
    with pytest.raises(ConfigError, match="--device cuda: CUDA is not available"):
        validated(["--device", "cuda"])


def test_file_errors(tmp_path: Path, no_cuda: None) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"--save: cannot create directory .*a_file/ckpt"):
        validated(["--save", str(blocker / "ckpt")])
    with pytest.raises(ConfigError, match=r"--load: directory .*missing does not exist"):
        validated(["--load", str(tmp_path / "missing")])
    with pytest.raises(ConfigError, match=r"--data-path: .*corpus_text_document.bin does not exist"):
        validated(["--data-path", str(tmp_path / "corpus_text_document")])
    (tmp_path / "a.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"--train-data-path: .*a.idx does not exist"):
        validated(["--train-data-path", "0.7", str(tmp_path / "a")])
    with pytest.raises(ConfigError, match=r"--vocab-file: file .*vocab.json does not exist"):
        validated(["--vocab-file", str(tmp_path / "vocab.json")])
    with pytest.raises(ConfigError, match=r"--tokenizer-model: .*tok.model does not exist"):
        validated(["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(tmp_path / "tok.model")])


def test_existing_files_pass(tmp_path: Path, no_cuda: None) -> None:
    for prefix in ("a", "b"):
        (tmp_path / f"{prefix}.bin").write_bytes(b"")
        (tmp_path / f"{prefix}.idx").write_bytes(b"")
    (tmp_path / "vocab.json").write_text("{}")
    (tmp_path / "merges.txt").write_text("")
    save = tmp_path / "new" / "ckpt"
    cfg = validated(["--data-path", "0.7", str(tmp_path / "a"), "0.3", str(tmp_path / "b"),
                     "--vocab-file", str(tmp_path / "vocab.json"), "--merge-file", str(tmp_path / "merges.txt"),
                     "--save", str(save), "--load", str(save)])  # --load == --save: a fresh resumable run
    assert save.is_dir()
    assert cfg.data.tokenizer_type == "GPT2BPETokenizer"


def test_optional_packages_are_checked(monkeypatch: pytest.MonkeyPatch, no_cuda: None) -> None:
    monkeypatch.setattr(validation, "_module_available", lambda name: False)
    with pytest.raises(ConfigError, match=r"--wandb-project needs the wandb package: pip install 'meshtron\[wandb\]'"):
        validated(["--wandb-project", "p"])
    with pytest.raises(ConfigError, match=r"--tensorboard-dir needs the tensorboard package"):
        validated(["--tensorboard-dir", "tb"])


def test_derived_defaults_cpu(no_cuda: None) -> None:
    cfg = validated(SHAPE + ["--micro-batch-size", "2", "--train-iters", "50", "--recompute-granularity", "full"], 4)
    assert cfg.train.global_batch_size == 8  # micro x DP
    assert cfg.model.max_position_embeddings == cfg.model.seq_length
    assert cfg.model.num_query_groups == 4
    assert cfg.model.ffn_hidden_size == 256
    assert cfg.optim.lr_decay_iters == 50
    assert cfg.train.recompute_method == "uniform"
    assert (cfg.train.device, cfg.train.bf16, cfg.train.fp32, cfg.train.compile) == ("cpu", False, True, False)
    assert cfg.parallel.expert_tensor_parallel_size == 1


def test_derived_defaults_cuda(cuda: None) -> None:
    cfg = validated(SHAPE + ["--tensor-model-parallel-size", "2"], 2)
    assert (cfg.train.device, cfg.train.bf16, cfg.train.fp32, cfg.train.compile) == ("cuda", True, False, True)
    assert cfg.parallel.expert_tensor_parallel_size == 2
    assert validated(SHAPE + ["--fp8-hybrid"]).train.fp8_format == "hybrid"
    assert validated(SHAPE + ["--recompute-granularity", "selective"]).train.recompute_granularity == "selective"
    assert validated(SHAPE + ["--fp32"]).train.bf16 is False
    assert validated(SHAPE + ["--no-compile"]).train.compile is False


def test_bf16_on_cpu_is_allowed(no_cuda: None) -> None:
    cfg = validated(SHAPE + ["--bf16"])
    assert (cfg.train.device, cfg.train.bf16, cfg.train.fp32) == ("cpu", True, False)


def test_gqa_replication_and_megatron_default(no_cuda: None) -> None:
    # TP 4 > 2 query groups: key/value heads are replicated, which is allowed.
    cfg = validated(SHAPE + ["--group-query-attention", "--num-query-groups", "2", "--tensor-model-parallel-size", "4"],
                    4)
    assert cfg.model.num_query_groups == 2
    assert validated(SHAPE + ["--group-query-attention"]).model.num_query_groups == 1  # Megatron's default


def test_uneven_and_virtual_pipeline(no_cuda: None) -> None:
    cfg = validated(SHAPE + ["--num-layers", "10", "--pipeline-model-parallel-size", "4",
                             "--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "3"], 4)
    assert cfg.parallel.pipeline_model_parallel_size == 4
    cfg = validated(SHAPE + ["--num-layers", "8", "--pipeline-model-parallel-size", "2",
                             "--num-layers-per-virtual-pipeline-stage", "2", "--global-batch-size", "2"], 2)
    assert cfg.parallel.virtual_pipeline_model_parallel_size == 2
    with pytest.raises(ConfigError, match="multiple of --pipeline-model-parallel-size"):
        validated(SHAPE + ["--num-layers", "8", "--pipeline-model-parallel-size", "2",
                           "--num-layers-per-virtual-pipeline-stage", "2", "--global-batch-size", "3"], 2)


def test_context_and_expert_parallel_layouts_are_accepted(no_cuda: None) -> None:
    cfg = validated(SHAPE + ["--context-parallel-size", "2", "--num-experts", "4", "--expert-model-parallel-size", "4",
                             "--tensor-model-parallel-size", "2"], 8)
    assert data_parallel_size(cfg, 8) == 2


def test_validate_is_idempotent(no_cuda: None) -> None:
    cfg = validated(SHAPE + ["--micro-batch-size", "2"], 2)
    snapshot = cfg.to_dict()
    validate_config(cfg, 2)
    assert cfg.to_dict() == snapshot


def test_unknown_world_size_skips_layout_checks(no_cuda: None) -> None:
    cfg = build_config(SHAPE + ["--tensor-model-parallel-size", "4"])
    validate_config(cfg, None)
    assert cfg.train.global_batch_size is None


def test_parse_data_path() -> None:
    assert parse_data_path(["0.7", "A", "0.3", "B"]) == [(0.7, "A"), (0.3, "B")]
    assert parse_data_path(["0.7 A 0.3 B"]) == [(0.7, "A"), (0.3, "B")]
    assert parse_data_path(["A", "B"]) == [(None, "A"), (None, "B")]
    with pytest.raises(ConfigError, match="weights must be finite numbers >= 0"):
        parse_data_path(["-1", "A", "2", "B"])


@pytest.mark.parametrize("items,words", [
    (["/data/my corpus/text"], ["/data/my corpus/text"]),                      # a prefix with a space: whole
    (["0.7 /data/my corpus/a", "0.3 b"], ["0.7", "/data/my corpus/a", "0.3", "b"]),  # weighted items
    (["0.7 A 0.3 B"], ["0.7", "A", "0.3", "B"]),                                # a whole blend in one item
    (["0.7", "A", " B "], ["0.7", "A", "B"]),                                   # argparse's items, stripped
])
def test_data_path_items_split_only_weighted_items(items: list[str], words: list[str]) -> None:
    assert validation.data_path_items(items) == words


def test_data_pipeline_reads_data_path_items_the_same_way() -> None:
    from meshtron.data.build import parse_weighted_paths

    assert parse_weighted_paths(["/data/my corpus/text"], "--data-path") == (None, ["/data/my corpus/text"])
    assert parse_weighted_paths(["0.7 /data/my corpus/a", "0.3 b"], "--data-path") == (
        [0.7, 0.3], ["/data/my corpus/a", "b"])


def test_missing_prefix_with_a_space_says_an_item_is_one_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="one item with spaces is one path"):
        validated(SHAPE + ["--data-path", str(tmp_path / "a b"), "--vocab-size", "64", "--tokenizer-type",
                           "NullTokenizer"])


@pytest.mark.parametrize("model,vocab,kind,refused", [
    (None, 100, "HuggingFaceTokenizer", True), (None, 200000, "HuggingFaceTokenizer", False),
    (None, None, "HuggingFaceTokenizer", False), (None, 100, "NullTokenizer", False),
    ("gpt2-small", 50257, "TikTokenizer", False),  # the preset's own size: replaced by the tokenizer's
    ("gpt2-small", 1000, "TikTokenizer", True),
])
def test_vocab_size_below_the_tokenizers_is_refused(model, vocab, kind, refused) -> None:
    from meshtron.config import ModelConfig

    m = ModelConfig(model=model, vocab_size=vocab)
    if not refused:
        validation.check_vocab_size(m, 128256, kind)
        return
    with pytest.raises(ConfigError, match=f"--vocab-size {vocab} is smaller than the tokenizer's vocabulary of "
                                          f"128256 tokens \\({kind}\\)"):
        validation.check_vocab_size(m, 128256, kind)


def test_parse_split() -> None:
    assert parse_split("969,30,1") == [969, 30, 1]
    assert parse_split("98/2") == [98, 2, 0]
    with pytest.raises(ConfigError, match="--split"):
        parse_split("0,0,0")


def _example_world_size(path: Path) -> int:
    match = re.search(r"^#\s*world-size:\s*(\d+)", path.read_text(), flags=re.MULTILINE)
    return int(match.group(1)) if match else 1


EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def test_examples_exist() -> None:
    assert {p.name for p in EXAMPLES} >= {"tiny_cpu.yaml", "llama3_8b.yaml", "gpt2_small.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_config_validates(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cuda: None) -> None:
    monkeypatch.chdir(tmp_path)  # relative --save / --metrics-file paths land here
    cfg = validated(["--config", str(path)], _example_world_size(path))
    assert cfg.model.model is not None


def test_async_tensor_parallel_needs_cuda_compile_and_sequence_parallel():
    from meshtron.cli import build_config
    from meshtron.config import ConfigError

    with pytest.raises(ConfigError, match="--async-tensor-parallel needs --device cuda"):
        validated(["--mock-data", "--vocab-size", "100", "--device", "cpu", "--tensor-model-parallel-size", "2",
                   "--sequence-parallel", "--async-tensor-parallel"], 2)


def test_megatron_spellings_map_to_meshtron_settings(no_cuda: None) -> None:
    cfg = validated(SHAPE + ["--num-layers", "8", "--pipeline-model-parallel-size", "2",
                             "--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "2",
                             "--no-overlap-p2p-communication",
                             "--recompute-activations", "--use-rotary-position-embeddings",
                             "--position-embedding-type", "learned_absolute"], 2)
    assert cfg.parallel.virtual_pipeline_model_parallel_size == 2
    assert cfg.parallel.overlap_p2p_comm is False
    assert cfg.train.recompute_granularity == "selective"
    assert cfg.model.position_embedding_type == "rope"
    # Implementation choices meshtron makes itself: accepted, nothing to configure.
    validated(SHAPE + ["--attention-backend", "flash", "--no-gradient-accumulation-fusion", "--cross-entropy-loss-fusion",
                       "--moe-permute-fusion", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
                       "--no-bias-dropout-fusion", "--no-rope-fusion", "--log-throughput", "--timing-log-level", "2",
                       "--moe-router-dtype", "fp32", "--accumulate-allreduce-grads-in-fp32", "--ddp-average-in-collective",
                       "--no-async-tensor-model-parallel-allreduce", "--override-opt_param-scheduler",
                       "--attention-softmax-in-fp32", "--calculate-per-token-loss",
                       "--no-check-for-nan-in-loss-and-grad", "--use-dist-ckpt", "--auto-detect-ckpt-format",
                       "--no-ckpt-fully-parallel-save", "--ckpt-fully-parallel-load",
                       "--ckpt-assume-constant-structure", "--log-memory-to-tensorboard",
                       "--log-validation-ppl-to-tensorboard", "--apply-query-key-layer-scaling",
                       "--no-bias-gelu-fusion", "--use-rotary-position-embeddings", "--no-position-embedding"])


def test_sample_based_schedule_becomes_iterations(no_cuda: None) -> None:
    cfg = validated(SHAPE + ["--global-batch-size", "8", "--train-samples", "1000", "--lr-warmup-samples", "80",
                             "--lr-decay-samples", "800"])
    assert (cfg.train.train_iters, cfg.optim.lr_warmup_iters, cfg.optim.lr_decay_iters) == (125, 10, 100)
    with pytest.raises(ConfigError, match="--lr-decay-samples and --lr-decay-iters exclude each other"):
        validated(SHAPE + ["--lr-decay-samples", "800", "--lr-decay-iters", "5"])
    with pytest.raises(ConfigError, match=r"--train-samples \(4\) must be at least one --global-batch-size \(8\)"):
        validated(SHAPE + ["--global-batch-size", "8", "--train-samples", "4"])


def test_sample_based_schedule_survives_a_second_validation(no_cuda: None) -> None:
    # `meshtron train` validates, then run_training validates again: the filled iterations must not
    # read as a contradiction of the sample counts they came from.
    cfg = validated(SHAPE + ["--global-batch-size", "8", "--lr-warmup-samples", "80", "--lr-decay-samples", "800"])
    snapshot = cfg.to_dict()
    validate_config(cfg, 1)
    assert cfg.to_dict() == snapshot


def test_check_changes_nothing(no_cuda: None) -> None:
    cfg = build_config(SHAPE + ["--micro-batch-size", "2", "--num-experts", "4", "--recompute-activations"])
    validation.resolve(cfg, 2)
    snapshot = cfg.to_dict()
    validation.check(cfg, 2)
    assert cfg.to_dict() == snapshot


def test_expert_tensor_parallel_size_is_refused_before_any_process_group() -> None:
    # The model builder cannot split experts over other TP ranks than the dense layers: say so up front.
    with pytest.raises(ConfigError, match=r"--expert-tensor-parallel-size \(1\) must equal "
                                          r"--tensor-model-parallel-size \(2\)"):
        validated(SHAPE + ["--device", "cpu", "--num-experts", "4", "--tensor-model-parallel-size", "2",
                           "--expert-tensor-parallel-size", "1"], 2)
    cfg = validated(SHAPE + ["--device", "cpu", "--num-experts", "4", "--tensor-model-parallel-size", "2"], 2)
    assert cfg.parallel.expert_tensor_parallel_size == 2


def test_process_groups_use_the_validation_layout_rule() -> None:
    from meshtron.parallel.context import check_layout

    assert check_layout(8, 2, 1, 2, 1) == 2
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by TP\(4\) x CP\(1\) x PP\(1\) = 4"):
        check_layout(6, 4, 1, 1, 1)
    with pytest.raises(ConfigError, match=r"--expert-model-parallel-size \(4\) must divide data-parallel size \(2\)"):
        check_layout(2, 1, 1, 1, 4)


def test_infinity_only_where_the_field_allows_it(no_cuda: None) -> None:
    assert validated(SHAPE + ["--exit-duration-in-mins", "inf"]).train.exit_duration_in_mins == float("inf")
    with pytest.raises(ConfigError, match="--exit-duration-in-mins must be a finite number, got nan"):
        validated(SHAPE + ["--exit-duration-in-mins", "nan"])
    cfg = build_config(SHAPE + ["--device", "cpu"])
    cfg.optim.adam_beta1 = float("nan")  # set in code, not parsed: the same rule holds
    with pytest.raises(ConfigError, match="--adam-beta1 must be a finite number, got nan"):
        validate_config(cfg, 1)


# A checker that runs with torch and numpy unimportable: each case prints "ok ..." or "error <message>".
_WITHOUT_TORCH = r'''
import json, sys


class RefuseHeavyImports:
    """An import finder that makes torch and numpy unimportable."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "numpy"):
            raise ImportError(f"{name} is blocked")
        return None


sys.meta_path.insert(0, RefuseHeavyImports())
from meshtron.cli import build_config
from meshtron.errors import ConfigError
from meshtron.validation import validate_run
import meshtron.pipeline.partition

out = []
for argv, world in json.loads(sys.argv[1]):
    try:
        cfg = build_config(argv)
        layout = validate_run(cfg, world)  # the resolved layout is torch-free too
        assert layout.pipeline.virtual_stages == (cfg.parallel.virtual_pipeline_model_parallel_size or 1)
        out.append(["ok", cfg.parallel.virtual_pipeline_model_parallel_size, cfg.train.global_batch_size])
    except ConfigError as err:
        out.append(["error", str(err)])
# The integer rules of the rank layout (meshtron.parallel.layout) are torch-free; the process groups are not.
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in ("torch", "numpy")
                or (m.startswith(("meshtron.model", "meshtron.layers", "meshtron.parallel", "meshtron.pipeline.s"))
                    and m not in ("meshtron.parallel", "meshtron.parallel.layout")))
print(json.dumps({"results": out, "loaded": loaded}))
'''


def test_checking_a_config_needs_no_torch() -> None:
    import json
    import subprocess
    import sys

    cpu = ["--device", "cpu"]
    cases = [
        (SHAPE + cpu + ["--num-layers", "8", "--pipeline-model-parallel-size", "2",
                        "--num-layers-per-virtual-pipeline-stage", "2", "--global-batch-size", "8"], 4),
        (SHAPE + cpu + ["--num-layers", "7", "--pipeline-model-parallel-size", "2"], 2),
        (SHAPE + cpu + ["--num-layers", "10", "--pipeline-model-parallel-size", "3",
                        "--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "4"], 3),
        (SHAPE + cpu + ["--tensor-model-parallel-size", "4"], 6),
        (SHAPE + cpu + ["--lr", "nan"], 1),
    ]
    result = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, json.dumps(cases)], capture_output=True,
                            text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["loaded"] == []
    ok, uneven_pp, uneven_split, world, nan = report["results"]
    assert ok == ["ok", 2, 8]
    assert uneven_pp[0] == "error" and "--num-layers (7) must be divisible by --pipeline-model-parallel-size (2)" \
        in uneven_pp[1]
    assert uneven_split == ["ok", None, 1]
    assert world[0] == "error" and "world size 6 is not divisible" in world[1]
    assert nan == ["error", "--lr must be a finite number, got nan"]

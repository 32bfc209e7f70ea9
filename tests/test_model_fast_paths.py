"""The forward's fast paths give the reference's results: grouped decode attention, fused
q/k/v and gate/up weights that follow every way the engine changes weights, and the GEMM
kernel choices (GEMV for one row, optional prepacked weights)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tgengine.agent.inputs import prepare_inputs
from tgengine.core.step import SeqStep
from tgengine.kernels import pair_panels
from tgengine.kernels.isa import isa
from tgengine.models import CausalLM, KVCache, load_model, load_model_config
from tgengine.models import attention as attention_module
from tgengine.models import gemm as gemm_module
from tgengine.models.fused import fused_rows
from tgengine.models.gemm import Gemm, LinearWeights, Panels, can_pack_panels, can_prepack
from tgengine.models.weights import pack_weights
from tgengine.sampling import SamplingParams

BLOCK_SIZE = 4
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def _prompts(vocab: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _prefill_then_decode(
    model: CausalLM, prompts: list[list[int]], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Prefill every prompt in one step, then one decode step of all; the decode logits.

    Each prompt decodes its first token again, not the prefill's argmax: two kernels that
    sum in different orders may pick different argmaxes where a tiny random model's top
    logits nearly tie, and then their decode logits could not be compared."""
    config = model.config
    cache = KVCache.allocate(config, 128, BLOCK_SIZE, dtype, "cpu")
    blocks = list(range(128))
    random.Random(0).shuffle(blocks)
    tables, seqs = [], []
    for prompt in prompts:
        table = [blocks.pop() for _ in range(-(-(len(prompt) + 1) // BLOCK_SIZE))]
        tables.append(table)
        seqs.append(SeqStep(str(len(seqs)), prompt, 0, table, GREEDY))
    with torch.inference_mode():
        model(prepare_inputs(seqs, BLOCK_SIZE, torch.device("cpu")), cache)  # fills the KV
        steps = [SeqStep(str(i), [p[0]], len(p), tables[i], GREEDY) for i, p in enumerate(prompts)]
        for i, step in enumerate(steps):
            prompts[i] = [*prompts[i], step.token_ids[0]]
        return model(prepare_inputs(steps, BLOCK_SIZE, torch.device("cpu")), cache)


def assert_same_argmax(got: torch.Tensor, want: torch.Tensor, margin: float) -> None:
    """``got`` picks ``want``'s greedy token in every row whose top two logits are more than
    ``margin`` apart (rows nearer a tie may go either way within the tolerance)."""
    top = want.topk(2, dim=-1).values
    clear = (top[:, 0] - top[:, 1]) > margin
    assert clear.any(), "no row to check: every top pair nearly ties"
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def _reference(model_dir: Path, prompts: list[list[int]]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.stack([ref(torch.tensor([p])).logits[0, -1] for p in prompts])


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_decode_in_length_groups_matches_transformers(
    fixture: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = request.getfixturevalue(fixture)
    config = load_model_config(model_dir)
    model = load_model(config, model_dir, torch.float32, "cpu")
    model.use_kernels = False  # the torch path's length groups (tests/test_kernels.py: the kernel)
    lengths = [3, 60, 9, 41, 2, 27, 55, 14]
    ungrouped = _prefill_then_decode(model, _prompts(config.vocab_size, lengths))
    monkeypatch.setattr(attention_module, "_GROUP_COST_BLOCKS", 0)
    prompts = _prompts(config.vocab_size, lengths)
    grouped = _prefill_then_decode(model, prompts)
    expected = _reference(model_dir, prompts)
    torch.testing.assert_close(grouped, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(grouped, ungrouped, atol=1e-5, rtol=0)
    assert grouped.argmax(-1).tolist() == expected.argmax(-1).tolist()


def test_split_by_width_saves_padding_only_when_worth_it() -> None:
    split = attention_module._split_by_width
    assert split([3] * 50) == [(0, 50)]
    groups = split([1] * 40 + [48] * 8)
    assert groups == [(0, 40), (40, 48)]
    assert len(split(list(range(1, 257)))) <= attention_module._MAX_GROUPS


def test_fused_weights_follow_in_place_updates_and_replacements(tiny_qwen2_dir: Path) -> None:
    config = load_model_config(tiny_qwen2_dir)
    model = load_model(config, tiny_qwen2_dir, torch.float32, "cpu")
    fresh = load_model(config, tiny_qwen2_dir, torch.float32, "cpu")
    lengths = [5, 11]
    _prefill_then_decode(model, _prompts(config.vocab_size, lengths))  # fuses
    attn = model.model.layers[0].self_attn
    projs = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    storage = {p.untyped_storage().data_ptr() for p in projs}
    assert len(storage) == 1, "q/k/v share one buffer after a forward"

    # A weight update writes in place through .data, as ModelAgent.update_weights does.
    new_k = torch.randn_like(attn.k_proj.weight)
    attn.k_proj.weight.data.copy_(new_k)
    fresh.model.layers[0].self_attn.k_proj.weight.data.copy_(new_k)
    rows = attn.q_proj.weight.shape[0]
    fused = fused_rows(projs)
    assert torch.equal(fused[rows : rows + new_k.shape[0]], new_k)

    # Sleep empties .data; wakeup (level 2) points it at fresh tensors, then reloads.
    saved = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.data = torch.empty(0)
    for name, p in model.named_parameters():
        p.data = saved[name].clone()
    prompts = _prompts(config.vocab_size, lengths)
    got = _prefill_then_decode(model, prompts)
    want = _prefill_then_decode(fresh, _prompts(config.vocab_size, lengths))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert len({p.untyped_storage().data_ptr() for p in projs}) == 1


def test_gemm_kernels_compute_the_same_products() -> None:
    torch.manual_seed(0)
    weight = torch.randn(96, 64).to(torch.bfloat16)
    bias = torch.randn(96).to(torch.bfloat16)
    gemm = Gemm()
    for rows in (1, 2, 8, 200):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        expected = F.linear(x.float(), weight.float(), bias.float())
        got = gemm.linear(x, weight, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
        torch.testing.assert_close(got.float(), expected, atol=0.25, rtol=0.02)
        assert torch.backends.mkldnn.enabled, "the GEMV path restores oneDNN"
    x32 = torch.randn(1, 64)
    assert torch.equal(gemm.linear(x32, weight.float()), F.linear(x32, weight.float()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weights_replace_the_plain_ones(dtype: torch.dtype) -> None:
    if not (can_prepack(dtype) or can_pack_panels(dtype)):
        pytest.skip(f"neither oneDNN nor tgengine's panels pack {dtype} weights on this CPU")
    torch.manual_seed(0)
    linears = [torch.nn.Linear(64, n, bias=False).to(dtype).requires_grad_(False) for n in (96, 32)]
    params = [linear.weight for linear in linears]
    plain = torch.cat([p.detach() for p in params])
    weights = LinearWeights(linears)
    gemm = Gemm()
    gemm.prepack = True
    gemm.pack(weights)
    assert weights.packed is not None
    # oneDNN's layout is the weight's size; panels round 128 rows up to 16: the same here.
    assert gemm.packed_bytes == plain.numel() * plain.element_size()
    for p in params:  # shapes kept, storage released
        assert p.shape[1] == 64 and p.untyped_storage().nbytes() <= p.element_size()
    with pytest.raises(RuntimeError, match="packed"):
        weights.plain()
    tol = 1e-5 if dtype == torch.float32 else 0.05
    for rows in (1, 2, 8, 200):
        x = torch.randn(rows, 64).to(dtype)
        got = gemm.linear(x, weights)
        torch.testing.assert_close(
            got.float(), F.linear(x.float(), plain.float()), atol=tol, rtol=tol
        )
    form = gemm.packed_form(dtype)
    assert isinstance(weights.packed, Panels) == (form in ("panels", "pairs")), form
    gemm.unpack(weights)
    assert weights.packed is None and gemm.packed_bytes == 0
    assert torch.equal(weights.plain(), plain), "unpacking is exact"


def test_pair_panels_run_onednn_from_prefill_sizes_where_the_cpu_has_amx(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # From PAIRS_ONEDNN_MIN_ROWS rows, on AMX, a product on pair panels unpacks its weight
    # (into a reused buffer) and runs oneDNN's GEMM: the same bits as F.linear on the plain
    # weight. Below it, with AMX off, for float32 output and for weights over the size cap,
    # the panels' own kernel runs. The spy says which ran.
    if "amx" not in pair_panels.pair_panel_variants():
        pytest.skip(f"oneDNN's AMX GEMM at prefill sizes needs AMX (this CPU: {isa()})")
    torch.manual_seed(0)
    linears = [
        torch.nn.Linear(64, n, bias=False).bfloat16().requires_grad_(False) for n in (96, 40)
    ]
    plain = torch.cat([linear.weight.detach() for linear in linears])
    weights = LinearWeights(linears)
    gemm = Gemm()
    gemm.prepack = True
    gemm.pack(weights)
    assert isinstance(weights.packed, Panels) and weights.packed.pair_cols == 64
    unpacked = []
    real = pair_panels.unpack_pair_panels

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        unpacked.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(pair_panels, "unpack_pair_panels", spy)
    bias = torch.randn(136).bfloat16()
    low = gemm_module.PAIRS_ONEDNN_MIN_ROWS
    for rows, dense in ((low - 1, False), (low, True), (low + 300, True)):
        unpacked.clear()
        x = torch.randn(rows, 64).bfloat16()
        got = gemm.linear(x, weights, bias)
        assert unpacked == ([136] if dense else []), rows
        if dense:
            assert torch.equal(got, F.linear(x, plain, bias))
            assert torch.equal(gemm.linear(x.view(2, -1, 64), weights, bias).view(rows, -1), got)
        torch.testing.assert_close(
            got.float(), F.linear(x.float(), plain.float(), bias.float()), atol=0.05, rtol=0.02
        )
    x = torch.randn(low, 64).bfloat16()
    unpacked.clear()
    gemm.linear(x, weights, float_output=True)
    monkeypatch.setattr(gemm_module, "PAIRS_ONEDNN_MAX_ELEMENTS", 136 * 64 - 1)
    gemm.linear(x, weights)
    monkeypatch.undo()
    monkeypatch.setattr(pair_panels, "unpack_pair_panels", spy)
    before = pair_panels.amx()
    try:
        pair_panels.set_amx(False)
        gemm.linear(x, weights)
    finally:
        pair_panels.set_amx(before)
    assert unpacked == [], "float32 output, a weight over the cap, AMX off: the panels' kernel"


@pytest.mark.skipif(not can_pack_panels(torch.bfloat16), reason="no panels on this CPU")
def test_a_tied_head_packs_into_panels_that_the_embedding_reads(tiny_qwen2_dir: Path) -> None:
    # The tied head is the embedding: packed once into panels (oneDNN's layout gives no rows
    # back), its lookups read the panels and its placeholder holds nothing.
    config = load_model_config(tiny_qwen2_dir)
    assert config.tie_word_embeddings
    plain = load_model(config, tiny_qwen2_dir, torch.bfloat16, "cpu")
    packed = load_model(config, tiny_qwen2_dir, torch.bfloat16, "cpu")
    packed.gemm.prepack = True
    pack_weights(packed)
    assert isinstance(packed.head.packed, Panels)
    embed = packed.model.embed_tokens
    assert embed.weight.untyped_storage().nbytes() <= embed.weight.element_size()
    ids = torch.tensor([0, 1, 15, 16, 17, config.vocab_size - 1, 16])
    assert torch.equal(embed(ids), F.embedding(ids, plain.model.embed_tokens.weight))
    prompts = _prompts(config.vocab_size, [5, 9, 2])
    got = _prefill_then_decode(packed, [list(p) for p in prompts], torch.bfloat16)
    want = _prefill_then_decode(plain, [list(p) for p in prompts], torch.bfloat16)
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)
    assert_same_argmax(got, want, 0.1)


def test_upcast_products_match_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    # Where the CPU has no native bf16 products, bf16 weights are widened a few rows at a time:
    # the chunks together give the float32 product of the bf16 values, rounded once.
    from tgengine.models import gemm as gemm_module

    monkeypatch.setattr(gemm_module, "UPCAST_CHUNK", 64 * 10)  # 10 rows of 64 per chunk
    torch.manual_seed(0)
    weight = torch.randn(96, 64).to(torch.bfloat16)
    bias = torch.randn(96).to(torch.bfloat16)
    x = torch.randn(8, 64).to(torch.bfloat16)
    got = gemm_module._upcast_linear(x, weight, bias)
    want = F.linear(x.float(), weight.float(), bias.float()).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_kv_cache_is_head_major_underneath(tiny_llama_dir: Path) -> None:
    config = load_model_config(tiny_llama_dir)
    cache = KVCache.allocate(config, 6, BLOCK_SIZE, torch.float32, "cpu")
    heads = cache.layer_heads(1)
    assert heads.shape == (2, config.num_kv_heads, 6, BLOCK_SIZE, config.head_dim)
    assert heads.is_contiguous()
    heads[1, 0, 2, 3] = 7.0  # values, kv head 0, block 2, offset 3
    assert torch.equal(cache.kv[1, 1, 2 * BLOCK_SIZE + 3, 0], torch.full((config.head_dim,), 7.0))


def test_plan_splits_decode_rows_by_length(monkeypatch: pytest.MonkeyPatch) -> None:
    from tgengine.models.inputs import ForwardInputs

    lens = torch.tensor([4, 61, 10, 42, 3, 28, 56, 15])
    inputs = ForwardInputs(
        input_ids=torch.zeros(8, dtype=torch.long),
        positions=lens - 1,
        slot_mapping=torch.zeros(8, dtype=torch.long),
        decode_rows=torch.arange(8),
        decode_block_tables=torch.zeros(8, 16, dtype=torch.long),
        decode_context_lens=lens,
    )
    single = attention_module.AttentionPlan.build(inputs, BLOCK_SIZE, None)
    assert len(single.decodes) == 1 and single.decode_only
    monkeypatch.setattr(attention_module, "_GROUP_COST_BLOCKS", 0)
    plan = attention_module.AttentionPlan.build(inputs, BLOCK_SIZE, None)
    assert len(plan.decodes) > 1 and not plan.decode_only
    rows = sorted(r for d in plan.decodes for r in d.rows.tolist())
    assert rows == list(range(8))
    for d in plan.decodes:  # each group is padded only to its own longest sequence
        assert d.width == max(-(-int(n) // BLOCK_SIZE) for n in lens[d.rows])


def test_a_step_whose_every_row_samples_in_order_selects_no_logits_rows() -> None:
    """A decode step leaves ``logits_rows`` None (the forward then indexes nothing); a step
    with a prompt chunk, a row that does not sample or prompt log-probs still lists its rows."""
    cpu = torch.device("cpu")
    decode = [SeqStep("a", [5], 7, [0, 1], GREEDY), SeqStep("b", [6], 3, [2], GREEDY)]
    assert prepare_inputs(decode, BLOCK_SIZE, cpu).logits_rows is None
    chunk = [SeqStep("a", [5, 6, 7], 0, [0], GREEDY), SeqStep("b", [6], 3, [2], GREEDY)]
    assert prepare_inputs(chunk, BLOCK_SIZE, cpu).logits_rows.tolist() == [2, 3]  # type: ignore[union-attr]
    silent = [SeqStep("a", [5], 7, [0, 1], None), SeqStep("b", [6], 3, [2], GREEDY)]
    assert prepare_inputs(silent, BLOCK_SIZE, cpu).logits_rows.tolist() == [1]  # type: ignore[union-attr]
    targets = SeqStep("a", [5, 6, 7], 0, [0], None)  # a chunk: log-probs of its first token
    targets.prompt_targets = [6]
    rows = prepare_inputs([targets], BLOCK_SIZE, cpu).logits_rows
    assert rows is not None and rows.tolist() == [0]
    targets.prompt_targets, targets.params = [6, 7], GREEDY  # every row, in order: None
    assert prepare_inputs([targets], BLOCK_SIZE, cpu).logits_rows is None

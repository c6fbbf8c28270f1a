"""Incremental decoding (model/decode.py, model/cache.py): decoding in pieces of any size equals
the training forward, with packed documents, padded rows, images and prefix snapshots.

Equalities are checked on float64 models, where the two computations differ by the order of
their sums only (the KDA chunk form over other chunks, attention over other key tiles): the
measured relative RMS errors are 0 to 7.6e-15 (noted at each test), so a bound of 1e-9 leaves
room for any platform's round-off and none for a wrong state, tail, mask or routing (those
show up at 1e-3 and above).
"""

import functools
from pathlib import Path

import pytest
import torch

from model.batch import K3Batch, VisionInput, cu_seqlens_from_lengths
from model.config import k3_tiny, replace
from model.k3 import K3Model
from model.kda import KimiDeltaAttention
from model.ops.kda import kda_chunk
from model.vision import pack_visuals, vision_token_count
from tests.helpers.static_shapes import assert_static, record
from tests.helpers.tolerances import assert_close_rms, rel_rms

EXACT = 1e-9  # float64: measured 0 .. 7.6e-15 (see the module docstring)


def _text_config(**changes):
    # The per-expert loop: F.grouped_mm takes no float64 (the loop is its reference).
    cfg = k3_tiny()
    return replace(cfg, vision=None, moe=replace(cfg.moe, dispatch="loop"), **changes)


CONFIGS = {
    # The last layer is always MLA (K3Config.layer_types): "kda" swaps it for a KDA layer.
    "kda": lambda: _text_config(num_layers=4, attnres_block_size=2),
    "mla": lambda: _text_config(num_layers=4, mla_every=1, attnres_block_size=2),
    "k3_tiny": _text_config,
}


def _model(cfg, only_kda=False, dtype=torch.float64):
    """An eval-mode model with non-uniform AttnRes mixes and a Quantile Balancing bias that moves
    the routing (both start at zero)."""
    model = K3Model(cfg, seed=0)
    if only_kda:
        last = model.layers[str(cfg.num_layers - 1)]
        last.attn = KimiDeltaAttention(cfg)
        model.init_weights(0)
    model = model.to(dtype).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mix.query"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for balancer in model.balancers():
            balancer.bias.copy_(torch.randn(balancer.bias.shape, generator=g) * 0.05)
    return model


@functools.cache
def _cached_model(name):
    return _model(CONFIGS[name](), only_kda=name == "kda")


def _tokens(cfg, shape, seed):
    # Ids 5.. avoid the pad and image placeholder ids.
    return torch.randint(5, cfg.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def _forward_logits(model, tokens, cu_seqlens=None, vision=None):
    with torch.no_grad():
        return model(K3Batch(tokens, tokens, cu_seqlens, vision), return_logits=True).logits


def _decode_in_pieces(model, tokens, size, cache=None):
    cache = model.new_cache(tokens.shape[0]) if cache is None else cache
    pieces = [model.decode(tokens[:, s:s + size], cache) for s in range(0, tokens.shape[1], size)]
    return torch.cat(pieces, dim=1), cache


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("size", [1, 3, 7, 45])
def test_decoding_in_pieces_equals_the_forward(name, size):
    """45 tokens cross a 32-token KDA chunk and both AttnRes blocks; the configurations cover a
    KDA-only stack, an MLA-only stack and k3_tiny's mix, each with a dense first layer and MoE
    layers. Measured: KDA-only 0 (one call: the forward's own ops) to 4.4e-15, MLA-only 5.3e-16
    to 8.2e-16, k3_tiny 1.3e-15 (one call) to 7.6e-15 (single tokens)."""
    model = _cached_model(name)
    tokens = _tokens(model.cfg, (2, 45), seed=2)
    logits, cache = _decode_in_pieces(model, tokens, size)
    assert logits.dtype == torch.float64 and logits.shape == (2, 45, model.cfg.vocab_size)
    assert_close_rms(_forward_logits(model, tokens), logits, EXACT, f"{name}, pieces of {size}")
    assert cache.slots == 45 and cache.tokens_seen.tolist() == [45, 45]


def test_fp32_decoding_is_as_accurate_as_the_forward():
    """The fp32 paths (native CPU kernels where they apply) against the same model in float64:
    decoding's error is within twice the fp32 forward's own. Measured over three prompts: the
    forward 2.8e-6 to 4.4e-6, decoding 1.9e-6 to 4.0e-6 (ratio at most 1.2)."""
    cfg = replace(k3_tiny(), vision=None)
    model = _model(cfg, dtype=torch.float32)
    tokens = _tokens(cfg, (2, 45), seed=3)
    truth = _forward_logits(_cached_model("k3_tiny"), tokens)
    forward_error = rel_rms(truth, _forward_logits(model, tokens))
    for size in (1, 3, 45):
        logits, _ = _decode_in_pieces(model, tokens, size)
        assert_close_rms(truth, logits, 2 * forward_error, f"fp32, pieces of {size}")


def test_packed_documents_prefilled_then_decoded_equal_the_forward():
    """A prompt of several documents per row (cu_seqlens) prefilled in one call or in pieces,
    then decoded token by token, continuing each row's last document: neither the KDA state,
    the convolutions nor attention cross a document. Measured 3.4e-15 to 4.2e-15."""
    model = _cached_model("k3_tiny")
    cfg = model.cfg
    docs = [[11, 17, 12], [25, 15]]  # 28 and 25 are piece starts for pieces of 7 and 1
    prompt, more = _tokens(cfg, (2, 40), seed=4), _tokens(cfg, (2, 6), seed=5)
    whole = torch.cat([prompt, more], dim=1)
    reference = _forward_logits(model, whole, cu_seqlens_from_lengths(
        [docs[0][:-1] + [docs[0][-1] + 6], docs[1][:-1] + [docs[1][-1] + 6]], 46))
    for size in (None, 7, 1):
        cache = model.new_cache(2)
        cu = cu_seqlens_from_lengths(docs, 40)
        if size is None:
            logits = model.decode(prompt, cache, cu_seqlens=cu)
        else:
            logits, _ = model.prefill(prompt, cache, size, cu_seqlens=cu)
        logits = torch.cat([logits, _decode_in_pieces(model, more, 1, cache)[0]], dim=1)
        assert_close_rms(reference, logits, EXACT, f"documents, prefill pieces of {size}")


@pytest.mark.parametrize("documents", [False, True])
def test_rows_of_different_lengths_equal_each_row_alone(documents):
    """Rows padded on the right (`lengths`), one with no token at all, with or without several
    documents per row: each row's logits equal its own forward, padding kept out of the state,
    the tails and attention, and each row continuing its last document. Measured 9.5e-16 to
    2.9e-15."""
    model = _cached_model("k3_tiny")
    cfg = model.cfg
    lengths, docs = [30, 17, 0], [[12, 18], [9, 8], []]
    prompt, more = _tokens(cfg, (3, 30), seed=6), _tokens(cfg, (3, 5), seed=7)
    cache = model.new_cache(3)
    cu = cu_seqlens_from_lengths(docs, 30) if documents else None
    prefilled = model.decode(prompt, cache, lengths=torch.tensor(lengths), cu_seqlens=cu)
    decoded, _ = _decode_in_pieces(model, more, 1, cache)
    assert cache.tokens_seen.tolist() == [35, 22, 5] and cache.slots == 35
    # last_only: the logits at each row's last token alone (a prefill's next-token logits).
    last = model.decode(prompt, model.new_cache(3), lengths=torch.tensor(lengths),
                        cu_seqlens=cu, last_only=True)
    assert last.shape == (3, 1, cfg.vocab_size)
    for row, n in enumerate(lengths[:2]):
        assert_close_rms(prefilled[row, n - 1], last[row, 0], EXACT, f"last of row {row}")
    for row, n in enumerate(lengths):
        alone = torch.cat([prompt[row:row + 1, :n], more[row:row + 1]], dim=1)
        row_docs = (docs[row] or [0])[:-1] + [(docs[row] or [0])[-1] + 5]
        reference = _forward_logits(model, alone, cu_seqlens_from_lengths([row_docs], n + 5)
                                    if documents else None)
        logits = torch.cat([prefilled[row:row + 1, :n], decoded[row:row + 1]], dim=1)
        assert_close_rms(reference, logits, EXACT, f"row {row} of length {n}")


def test_prompt_with_images_prefilled_equals_the_forward():
    """An image in row 0 and a two-chunk video in row 1 go through MoonViT at prefill and
    replace their placeholders as in the forward; then text is decoded. The same prompt
    prefilled in pieces of 5 (an image cut between two) too. Measured 1.2e-15 (one call) and
    4.4e-15 (pieces)."""
    cfg = replace(k3_tiny(), moe=replace(k3_tiny().moe, dispatch="loop"))
    model = _model(cfg)
    g = torch.Generator().manual_seed(8)
    image = torch.randn(3, 56, 56, generator=g, dtype=torch.float64)
    video = torch.randn(6, 3, 56, 28, generator=g, dtype=torch.float64)
    patches, grid = pack_visuals([image, video], cfg.vision)
    counts = vision_token_count(grid, cfg.vision)  # 4 and 2 x 2 tokens
    places = [(0, 3 + i) for i in range(counts[0])] + [(1, 10 + i) for i in range(counts[1])]
    prompt, more = _tokens(cfg, (2, 24), seed=9), _tokens(cfg, (2, 4), seed=10)
    for row, col in places:
        prompt[row, col] = cfg.image_token_id

    def vision(t):
        positions = torch.tensor([row * t + col for row, col in places])
        return VisionInput(patches, grid, positions)

    whole = torch.cat([prompt, more], dim=1)
    reference = _forward_logits(model, whole, vision=vision(28))
    cache = model.new_cache(2)
    logits = torch.cat([model.decode(prompt, cache, vision=vision(24)),
                        _decode_in_pieces(model, more, 1, cache)[0]], dim=1)
    assert_close_rms(reference, logits, EXACT, "prompt with images")
    pieces, _ = model.prefill(prompt, model.new_cache(2), 5, vision=vision(24))
    assert_close_rms(reference[:, :24], pieces, EXACT, "prompt with images, pieces of 5")
    without = model.decode(prompt, model.new_cache(2))
    assert rel_rms(reference[:, :24], without) > 1e-3, "the images must reach the logits"


@pytest.mark.parametrize("name", ["kda", "k3_tiny"])
def test_rewinding_each_row_to_its_kept_positions_equals_decoding_only_those(name):
    """Calls with checkpoints (4 positions, then 1, one row padded to 2 in the first) and a
    rewind keeping 2, 5 and 1 of them per row: decoding on equals a row that only ever took its
    kept tokens; the dropped positions' slots stay, as padding. The states after each position
    come from the recurrence step by step, the forward's from the chunk form: measured
    3.3e-15 (kda) and 3.4e-15 (k3_tiny)."""
    model = _cached_model(name)
    cfg = model.cfg
    prompt, lengths = _tokens(cfg, (3, 10), seed=21), [10, 6, 8]
    first, second, after = (_tokens(cfg, (3, 4), seed=22), _tokens(cfg, (3, 1), seed=23),
                            _tokens(cfg, (3, 3), seed=24))
    cache = model.new_cache(3)
    model.decode(prompt, cache, lengths=torch.tensor(lengths))
    model.decode(first, cache, lengths=torch.tensor([4, 4, 2]), checkpoints=True)
    model.decode(second, cache, checkpoints=True)
    keep = [2, 5, 1]
    cache.rewind(torch.tensor(keep))
    assert cache.slots == 15 and cache.tokens_seen.tolist() == [12, 11, 9]
    decoded = model.decode(after, cache)
    for row in range(3):
        taken = torch.cat([first[row, :4 if row < 2 else 2], second[row]])[:keep[row]]
        alone = torch.cat([prompt[row, :lengths[row]], taken, after[row]])[None]
        reference = _forward_logits(model, alone)[:, -3:]
        assert_close_rms(reference, decoded[row:row + 1], EXACT, f"row {row} kept {keep[row]}")
    with pytest.raises(RuntimeError, match="checkpoints=True"):
        cache.rewind(torch.tensor(keep))


def _fla_naive_recurrent_kda():
    """fla's reference recurrence (fla/ops/kda/naive.py), loaded from the installed fla-core
    by its file: it needs only torch and einops, while importing the fla package needs triton,
    which a CPU machine lacks."""
    import importlib.util

    spec = importlib.util.find_spec("fla")
    if spec is None:
        pytest.skip("fla-core is not installed")
    path = Path(spec.submodule_search_locations[0]) / "ops" / "kda" / "naive.py"
    module_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.naive_recurrent_kda


def test_the_kda_prefill_state_equals_flas_naive_recurrence():
    """The first KDA layer's cached state after a prefill, and after a second one continuing it,
    equals fla's naive_recurrent_kda final state on the layer's own recurrence inputs (fla's
    reference computes in fp32: measured 1.3e-7 and 1.5e-7 relative to the float64 state)."""
    naive = _fla_naive_recurrent_kda()
    model = _cached_model("kda")
    layer = model.layers["0"]
    tokens = _tokens(model.cfg, (2, 40), seed=31)
    cache = model.new_cache(2)
    model.decode(tokens[:, :25], cache)
    first = cache.layers["0"].state.clone()
    model.decode(tokens[:, 25:], cache)
    with torch.no_grad():  # the layer's inputs as its forward computes them (layer 0: no mix)
        x = layer.attn_norm(model.embed_tokens(tokens, None))
        attn = layer.attn
        q, k, v = (conv(proj(x), None) for proj, conv in attn._convolutions())
        q, k, v, g, beta = attn._recurrence_inputs(x, q, k, v)
    _, state = naive(q[:, :25], k[:, :25], v[:, :25], g[:, :25], beta[:, :25],
                     output_final_state=True)
    assert rel_rms(first, state.double()) < 1e-6
    _, state = naive(q[:, 25:], k[:, 25:], v[:, 25:], g[:, 25:], beta[:, 25:],
                     initial_state=state, output_final_state=True)
    assert rel_rms(cache.layers["0"].state, state.double()) < 1e-6


def test_resuming_from_a_snapshot_equals_prefilling_the_whole_prompt():
    """A snapshot is a detached copy: the cache it came from decodes on, and a cache resumed
    from it decodes the suffix as if the whole prompt had been prefilled. Measured 3.5e-15."""
    model = _cached_model("k3_tiny")
    tokens = _tokens(model.cfg, (2, 40), seed=11)
    whole = model.decode(tokens, model.new_cache(2))
    cache = model.new_cache(2)
    model.decode(tokens[:, :24], cache)
    snapshot = cache.snapshot()
    model.decode(_tokens(model.cfg, (2, 9), seed=12), cache)  # changes the cache, not the copy
    resumed = model.new_cache(2, from_snapshot=snapshot)
    assert_close_rms(whole[:, 24:], model.decode(tokens[:, 24:], resumed), EXACT, "resumed")
    assert snapshot.slots == 24 and cache.slots == 33


def test_a_one_row_snapshot_fills_every_row():
    """A shared prefix prefilled once for one row, resumed for two rows with their own
    suffixes: each equals its whole prompt's forward. Measured 2.9e-15."""
    model = _cached_model("k3_tiny")
    cfg = model.cfg
    prefix, suffixes = _tokens(cfg, (1, 20), seed=13), _tokens(cfg, (2, 15), seed=14)
    cache = model.new_cache(1)
    model.decode(prefix, cache)
    resumed = model.new_cache(2, from_snapshot=cache.snapshot())
    logits = model.decode(suffixes, resumed)
    reference = _forward_logits(model, torch.cat([prefix.expand(2, -1), suffixes], dim=1))
    assert_close_rms(reference[:, 20:], logits, EXACT, "one-row snapshot, two suffixes")


def _truncated(docs, length):
    """Document lengths of each row cut at `length` positions."""
    rows = []
    for row in docs:
        ends = torch.tensor(row).cumsum(0).clamp(max=length)
        rows.append([n for n in torch.diff(ends, prepend=torch.zeros(1, dtype=ends.dtype)).tolist()
                     if n])
    return rows


def _assert_same_cache(expected, found, what):
    assert found.slots == expected.slots, what
    for name in ("tokens_seen", "document", "slot_documents"):
        assert torch.equal(getattr(expected, name), getattr(found, name)), f"{what}: {name}"
    tokens = expected.slot_documents >= 0  # padding slots hold unspecified latents
    for index, layer in expected.layers.items():
        other = found.layers[index]
        if hasattr(layer, "state"):
            assert_close_rms(layer.state, other.state, EXACT, f"{what}: layer {index} state")
            for a, b in zip(layer.conv_tails, other.conv_tails, strict=True):
                assert_close_rms(a, b, EXACT, f"{what}: layer {index} tail")
        else:
            assert_close_rms(layer.latent[tokens], other.latent[tokens], EXACT,
                             f"{what}: layer {index} latents")


def test_prefill_snapshots_equal_prefilling_exactly_each_prefix():
    """Snapshots every 8 positions of a prompt with documents and a padded row equal the cache
    after prefilling exactly that prefix; 16 cuts a document and 8 starts one in row 0, row 1's
    padding starts at 21. The logits equal one call's. Measured: logits 2.8e-15, states, tails
    and latents 0 (after 8) to 6.3e-15."""
    model = _cached_model("k3_tiny")
    docs, lengths = [[8, 14, 8], [12, 9]], torch.tensor([30, 21])
    tokens = _tokens(model.cfg, (2, 30), seed=15)
    cu = cu_seqlens_from_lengths(docs, 30)
    logits, snapshots = model.prefill(tokens, model.new_cache(2), 8, lengths=lengths,
                                      cu_seqlens=cu)
    one_call = model.decode(tokens, model.new_cache(2), lengths=lengths, cu_seqlens=cu)
    tokens_mask = torch.arange(30) < lengths[:, None]
    assert_close_rms(one_call[tokens_mask], logits[tokens_mask], EXACT, "prefill logits")
    assert [s.slots for s in snapshots] == [8, 16, 24]
    for snapshot in snapshots:
        n = snapshot.slots
        cache = model.new_cache(2)
        model.decode(tokens[:, :n], cache, lengths=lengths.clamp(max=n),
                     cu_seqlens=cu_seqlens_from_lengths(_truncated(docs, n), n))
        _assert_same_cache(cache, snapshot.cache, f"snapshot after {n}")


def test_single_token_recurrence_equals_the_chunk_form():
    """Single-token decoding runs the recurrence (KimiDeltaAttention.step_op); the chunk form
    run on one token at a time gives the same logits and states. Measured 4.4e-15 (logits) and
    2.3e-16 to 3.3e-15 (states)."""
    model = _cached_model("k3_tiny")
    tokens = _tokens(model.cfg, (2, 20), seed=16)
    recurrence, cache = _decode_in_pieces(model, tokens, 1)
    kda_layers = [layer.attn for layer in model.layers.values()
                  if isinstance(layer.attn, KimiDeltaAttention)]
    chunk_form = functools.partial(kda_chunk, chunk_size=model.cfg.kda.chunk_size,
                                   backend="torch", lower_bound=model.cfg.kda.gate_lower_bound)
    try:
        for layer in kda_layers:
            layer.step_op = chunk_form
        chunked, chunk_cache = _decode_in_pieces(model, tokens, 1)
    finally:
        for layer in kda_layers:
            del layer.step_op
    assert_close_rms(chunked, recurrence, EXACT, "single-token logits")
    for index, layer in cache.layers.items():
        if hasattr(layer, "state"):
            assert_close_rms(chunk_cache.layers[index].state, layer.state, EXACT, index)


def test_decoding_gathers_no_balancing_statistics_even_in_training_mode():
    """Decoding routes with the frozen bias whatever the mode: no statistics, same logits."""
    model = _cached_model("k3_tiny")
    tokens = _tokens(model.cfg, (2, 9), seed=17)
    evaluated = model.decode(tokens, model.new_cache(2))
    bias = [b.bias.clone() for b in model.balancers()]
    model.train()
    try:
        trained = model.decode(tokens, model.new_cache(2))
    finally:
        model.eval()
    assert torch.equal(evaluated, trained)
    for balancer, before in zip(model.balancers(), bias, strict=True):
        assert int(balancer.local_statistics().sum()) == 0 and torch.equal(balancer.bias, before)


def test_a_prefill_has_static_shapes_and_no_host_sync():
    """Two prompts with other documents and other row lengths (same shapes) run the same ops on
    the same shapes, none of them a host sync."""
    cfg = replace(k3_tiny(), vision=None)
    model = _model(cfg, dtype=torch.float32)
    tokens = _tokens(cfg, (2, 12), seed=18)

    def prefill(docs, lengths):
        cache = model.new_cache(2)
        model.decode(tokens[:, :4], cache)
        x = model.embed_tokens(tokens, None)
        cu = cu_seqlens_from_lengths(docs, 12)
        # The layers and the cache's bookkeeping; decode's input checks read host tensors.
        with torch.no_grad():
            return record(model._decode_embedded, x, cache, torch.tensor(lengths), cu)

    assert_static(prefill([[3, 9], [12]], [12, 8]), prefill([[7, 5], [12]], [10, 12]))


def test_bad_inputs_get_errors_naming_the_argument():
    cfg = _text_config(num_layers=4, max_seq_len=16)
    model = _model(cfg)
    tokens = _tokens(cfg, (2, 10), seed=19)
    cache = model.new_cache(2)
    with pytest.raises(ValueError, match="tokens has 2 rows but the cache holds 3"):
        model.decode(tokens, model.new_cache(3))
    with pytest.raises(ValueError, match="tokens must be integer ids"):
        model.decode(tokens[0], cache)
    with pytest.raises(ValueError, match="lengths must lie in"):
        model.decode(tokens, cache, lengths=[10, 11])
    with pytest.raises(ValueError, match="lengths must be 2 integer"):
        model.decode(tokens, cache, lengths=[10])
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        model.decode(tokens, cache, cu_seqlens=torch.tensor([0, 4, 20]))
    with pytest.raises(ValueError, match="vision was given"):
        model.decode(tokens, cache, vision=VisionInput(torch.zeros(1), torch.zeros(1, 3),
                                                       torch.zeros(1)))
    model.decode(tokens, cache)
    with pytest.raises(ValueError, match=r"past model.max_seq_len=16"):
        model.decode(tokens, cache)
    assert cache.slots == 10, "a refused call leaves the cache as it was"
    snapshot = cache.snapshot()
    with pytest.raises(TypeError, match="cache is a CacheSnapshot"):
        model.decode(tokens, snapshot)
    with pytest.raises(ValueError, match="batch_size=3 does not match from_snapshot's 2 rows"):
        model.new_cache(3, from_snapshot=snapshot)
    with pytest.raises(ValueError, match="from_snapshot was made for other layers"):
        _model(_text_config(num_layers=4, mla_every=1)).new_cache(2, from_snapshot=snapshot)
    with pytest.raises(ValueError, match="snapshot_every=0 is invalid"):
        model.prefill(tokens, model.new_cache(2), 0)
    with pytest.raises(ValueError, match="batch_size=0 is invalid"):
        model.new_cache(0)

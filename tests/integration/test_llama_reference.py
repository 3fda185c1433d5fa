"""The plain-torch Llama over a paged KV cache against Hugging Face transformers (the reference).

Tiny random models on CPU in float32: logits must agree to rounding, and greedy decoding token
for token, whether sequences run alone, batched with others, or prefilled in chunks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from services.gpu_worker.generation.llama import LlamaConfig
from services.gpu_worker.generation.model_runner import ModelRunner, SequenceBatchItem
from services.gpu_worker.generation.tiny_llama import create_tiny_llama

pytestmark = pytest.mark.integration

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 4
NUM_BLOCKS = 64
NUM_NEW_TOKENS = 20
PROMPTS = [
    [1, 17, 250, 3, 99],
    [1, 5, 5, 42, 8, 130, 77, 201, 64, 12, 9],
    [1, *range(100, 130, 2), 7, 299],
]


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = tmp_path_factory.mktemp("hf-llama")
    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(model_dir, safe_serialization=True)
    return model_dir


@pytest.fixture(scope="module")
def reference_model(reference_dir: Path):
    return transformers.LlamaForCausalLM.from_pretrained(reference_dir).eval()


def make_runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(
        model_dir,
        device=torch.device("cpu"),
        dtype=torch.float32,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
    )


def shuffled_blocks(seed: int) -> list[int]:
    """Free physical blocks in a random order, so block tables are never contiguous."""
    blocks = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(blocks)
    return blocks


def reference_greedy(model, prompt: list[int], num_new: int) -> list[int]:
    input_ids = torch.tensor([prompt])
    output = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=num_new,
        # No early stop at EOS (our loops don't stop either); min_new_tokens would instead
        # mask EOS out of the logits and change the tokens.
        eos_token_id=None,
        pad_token_id=0,
    )
    new_tokens = output[0, len(prompt) :].tolist()
    assert len(new_tokens) == num_new
    return new_tokens


@dataclass
class SeqState:
    """A test-side sequence: what the engine's scheduler and block manager would track."""

    prompt: list[int]
    output: list[int] = field(default_factory=list)
    num_cached: int = 0
    block_table: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def next_item(self, max_chunk: int, free_blocks: list[int]) -> SequenceBatchItem:
        new = self.tokens[self.num_cached : self.num_cached + max_chunk]
        end = self.num_cached + len(new)
        while len(self.block_table) * BLOCK_SIZE < end:
            self.block_table.append(free_blocks.pop())
        return SequenceBatchItem(tuple(new), self.num_cached, tuple(self.block_table))


def greedy_alone(runner: ModelRunner, prompt: list[int], free: list[int]) -> list[int]:
    seq = SeqState(prompt)
    while len(seq.output) < NUM_NEW_TOKENS:
        item = seq.next_item(len(seq.tokens), free)
        logits = runner.execute([item])
        seq.num_cached = item.end_position
        seq.output.append(int(logits[0].argmax()))
    return seq.output


def test_prefill_logits_match_transformers(reference_dir: Path, reference_model) -> None:
    runner = make_runner(reference_dir)
    prompts = PROMPTS
    items = []
    free = shuffled_blocks(seed=1)
    for prompt in prompts:
        items.append(SeqState(prompt).next_item(len(prompt), free))

    ours = runner.execute(items)

    assert ours.shape == (len(prompts), 300) and ours.dtype == torch.float32
    for row, prompt in enumerate(prompts):
        with torch.inference_mode():
            expected = reference_model(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(ours[row], expected, atol=1e-4, rtol=1e-4)


def test_greedy_decode_one_sequence_at_a_time_matches_generate(
    reference_dir: Path,
    reference_model,
) -> None:
    runner = make_runner(reference_dir)
    free = shuffled_blocks(seed=2)
    for prompt in PROMPTS:
        assert greedy_alone(runner, prompt, free) == reference_greedy(
            reference_model, prompt, NUM_NEW_TOKENS
        )


def test_batched_chunked_prefill_and_decodes_match_generate(
    reference_dir: Path,
    reference_model,
) -> None:
    runner = make_runner(reference_dir)
    free = shuffled_blocks(seed=3)
    sequences = [SeqState(prompt) for prompt in PROMPTS]
    num_mixed_steps = 0
    # Sequence i joins at step i, so steps mix prefill chunks of some with decodes of others.
    for step in range(200):
        active = [
            s for i, s in enumerate(sequences) if i <= step and len(s.output) < NUM_NEW_TOKENS
        ]
        if not active:
            break
        items = [s.next_item(3, free) for s in active]
        # A sequence still prefills until its prompt has produced the first token.
        is_prefill = [not s.output for s in active]
        num_mixed_steps += any(is_prefill) and not all(is_prefill)
        logits = runner.execute(items)
        for row, (item, seq) in enumerate(zip(items, active, strict=True)):
            seq.num_cached = item.end_position
            # A chunk that ends mid-prompt produces no token; the prompt's last chunk does.
            if seq.num_cached == len(seq.tokens):
                seq.output.append(int(logits[row].argmax()))

    assert num_mixed_steps > 0
    for seq in sequences:
        assert seq.output == reference_greedy(reference_model, seq.prompt, NUM_NEW_TOKENS)


def test_malformed_item_is_rejected(reference_dir: Path) -> None:
    runner = make_runner(reference_dir)
    with pytest.raises(ValueError, match="block table"):
        runner.execute([SequenceBatchItem(tuple(range(1, 10)), 0, (0, 1))])


def test_tiny_llama_agrees_with_transformers(tmp_path: Path) -> None:
    model_dir = create_tiny_llama(tmp_path / "tiny-llama", seed=0)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = "héllo, wörld 日本 🎉\n\t end"
    encoding = tokenizer.encode(text)
    assert tokenizer.decode(encoding.ids) == text
    config = LlamaConfig.from_json(model_dir / "config.json")
    assert encoding.ids[0] == config.bos_token_id
    assert tokenizer.id_to_token(config.eos_token_ids[0]) == "</s>"

    reference = transformers.LlamaForCausalLM.from_pretrained(model_dir).eval()
    runner = make_runner(model_dir)
    prompt = encoding.ids
    assert greedy_alone(runner, prompt, shuffled_blocks(seed=4)) == reference_greedy(
        reference, prompt, NUM_NEW_TOKENS
    )

"""Build the tiny random Llama model that real vLLM (CPU build) serves in fidelity runs.

No weights can be downloaded here, so the model is a 2-layer LlamaForCausalLM with random weights
(torch.manual_seed(0)) and Bouncer's own tokenizer (src/bouncer/data/tokenizer.json), so that
vLLM and Bouncer count prompt tokens identically. The chat template is Bouncer's
(src/bouncer/data/chat_template.jinja): <s>{role}\\n{content}</s>\\n ... <s>assistant\\n, with the
tools and each tool call as JSON.

With --vision it builds a tiny BLIP-2 instead (a random ViT, one Q-Former layer, a 2-layer OPT;
the same tokenizer plus an `<image>` token): vLLM puts each image in the prompt as
IMAGE_TOKENS tokens of its own, for checking what the gateway settles for chats with images.
(BLIP-2 because its vLLM code and processor need no torchvision, whose PyPI builds are CUDA's.)

Run it with the vLLM venv (it needs torch + transformers):

    .venv-vllm/bin/python scripts/make_tiny_model.py [--vision] [OUT_DIR]   # default .cache/tiny-model
"""

from __future__ import annotations

import argparse
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
TOKENIZER_JSON = REPO / "src/bouncer/data/tokenizer.json"

# Bouncer's own chat template (tools, tool calls and all), so vLLM renders chats as Bouncer does
CHAT_TEMPLATE = (REPO / "src/bouncer/data/chat_template.jinja").read_text()
IMAGE_TOKENS = 8  # the vision model's query tokens: what one image adds to a prompt


def build(out: pathlib.Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER_JSON), bos_token="<s>",
                                  eos_token="</s>", unk_token="<unk>", pad_token="<pad>")
    tok.chat_template = CHAT_TEMPLATE
    tok.model_max_length = 2048
    tok.save_pretrained(str(out))

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2048, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=2048,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(out))

    # Self-check: the HF tokenizer must give the same ids as the raw tokenizers.Tokenizer.
    from tokenizers import Tokenizer
    raw = Tokenizer.from_file(str(TOKENIZER_JSON))
    msgs = [{"role": "user", "content": "def f(x):\n    return x + 1"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    want = "<s>user\ndef f(x):\n    return x + 1</s>\n<s>assistant\n"
    assert text == want, (text, want)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    calls = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": {"x": "é"}}}]}]
    text = tok.apply_chat_template(calls, tools=tools, tokenize=False)
    want = ('<s>tools\n[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]</s>\n'
            '<s>assistant\n\n{"name": "f", "arguments": {"x": "é"}}</s>\n')
    assert text == want, (text, want)
    ids_hf = tok(text, add_special_tokens=True)["input_ids"]
    ids_raw = raw.encode(text).ids
    print(f"chat render ok; {len(ids_raw)} raw tokens; HF add_special_tokens=True gives "
          f"{len(ids_hf)} ({'same' if ids_hf == ids_raw else 'DIFFERENT'})")
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out} ({n} parameters, vocab {config.vocab_size})")


def build_vision(out: pathlib.Path) -> None:
    import torch
    from transformers import (
        Blip2Config,
        Blip2ForConditionalGeneration,
        Blip2Processor,
        Blip2QFormerConfig,
        Blip2VisionConfig,
        BlipImageProcessor,
        OPTConfig,
        PreTrainedTokenizerFast,
    )

    out.mkdir(parents=True, exist_ok=True)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER_JSON), bos_token="<s>",
                                  eos_token="</s>", unk_token="<unk>", pad_token="<pad>")
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.chat_template = CHAT_TEMPLATE
    tok.model_max_length = 2048
    images = BlipImageProcessor(size={"height": 56, "width": 56})  # 16 patches of 14 pixels
    Blip2Processor(image_processor=images, tokenizer=tok, num_query_tokens=IMAGE_TOKENS,
                   chat_template=CHAT_TEMPLATE).save_pretrained(str(out))
    tok.save_pretrained(str(out))

    torch.manual_seed(0)
    text = OPTConfig(vocab_size=len(tok), hidden_size=128, ffn_dim=256, num_hidden_layers=2, num_attention_heads=4,
                     word_embed_proj_dim=128, max_position_embeddings=2048, bos_token_id=tok.bos_token_id,
                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    vision = Blip2VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                               image_size=56, patch_size=14)
    qformer = Blip2QFormerConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                 encoder_hidden_size=32, vocab_size=len(tok))
    config = Blip2Config(vision_config=vision.to_dict(), qformer_config=qformer.to_dict(),
                         text_config=text.to_dict(), num_query_tokens=IMAGE_TOKENS,
                         image_token_index=tok.convert_tokens_to_ids("<image>"))
    model = Blip2ForConditionalGeneration(config)
    model.save_pretrained(str(out))
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out} (BLIP-2, {n} parameters, {IMAGE_TOKENS} tokens an image)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vision", action="store_true", help="a tiny BLIP-2 (images) instead of the text model")
    ap.add_argument("out", nargs="?")
    args = ap.parse_args()
    if args.vision:
        build_vision(pathlib.Path(args.out or REPO / ".cache/tiny-vision-model"))
    else:
        build(pathlib.Path(args.out or REPO / ".cache/tiny-model"))


if __name__ == "__main__":
    main()

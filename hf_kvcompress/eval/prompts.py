"""Turn a sample into the two token sequences of the protocol: the document part and the question part.

The document part is prefilled into the cache (and compressed) before the question part exists, as a served cache
sees a long document arrive before the user's question. Both parts come from one rendering of the whole prompt,
split at the end of the document, so a chat model sees exactly its chat template and a base model a plain
"document, question, answer" prompt. The runner and the lm-eval model both call `encode`, so the two see the
same tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

PromptFormat = Literal["auto", "chat", "plain"]
PROMPT_FORMATS = ("auto", "chat", "plain")
PROTOCOLS = ("document_first", "query_aware")
_SPLIT = "\u2063KVC-SPLIT\u2063"  # invisible separator: never in real text, kept verbatim by chat templates


def protocol_name(query_aware: bool) -> str:
    """`document_first`: the question is appended after compression; `query_aware`: it is also inside the document."""
    return "query_aware" if query_aware else "document_first"


def uses_chat(tokenizer, prompt_format: PromptFormat = "auto") -> bool:
    """Whether prompts go through the tokenizer's chat template (`auto`: when it has one)."""
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, got {prompt_format!r}")
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if prompt_format == "chat" and not has_template:
        raise ValueError("prompt_format='chat' needs a tokenizer with a chat template")
    return has_template if prompt_format == "auto" else prompt_format == "chat"


def render(
    tokenizer, sample: Mapping, *, query_aware: bool = False, prompt_format: PromptFormat = "auto"
) -> tuple[str, str]:
    """(document_text, question_text): the prompt, split where the document ends.

    `sample` needs the fields `instruction`, `document`, `question` and `answer_prefix` (see tasks.py). With
    `query_aware` the question is also placed before the document, inside the part the cache compresses.
    """
    instruction, document, question = sample["instruction"], sample["document"], sample["question"]
    answer_prefix = sample.get("answer_prefix") or ""
    head = f"{instruction}\n\n" if instruction else ""
    if query_aware:
        head += f"{question}\n\n"
    if uses_chat(tokenizer, prompt_format):
        content = f"{head}{document}{_SPLIT}\n\n{question}"
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        if rendered.count(_SPLIT) != 1:
            raise ValueError("the chat template changed the prompt's document/question separator")
        document_text, question_text = rendered.split(_SPLIT)
        return document_text, question_text + answer_prefix
    cue = answer_prefix or "Answer:"
    return f"{head}{document}", f"\n\n{question}\n{cue}"


def encode(
    tokenizer, sample: Mapping, *, query_aware: bool = False, prompt_format: PromptFormat = "auto"
) -> tuple[list[int], list[int]]:
    """Token ids of the document part and of the question part.

    The parts are tokenized separately, so the document's tokens do not depend on the question. A chat template
    writes its own special tokens (a BOS among them), so only a plain prompt asks the tokenizer to add them.
    """
    document_text, question_text = render(tokenizer, sample, query_aware=query_aware, prompt_format=prompt_format)
    special = not uses_chat(tokenizer, prompt_format)
    document_ids = tokenizer(document_text, add_special_tokens=special)["input_ids"]
    question_ids = tokenizer(question_text, add_special_tokens=False)["input_ids"]
    return list(document_ids), list(question_ids)


def plain_text(sample: Mapping) -> str:
    """The whole prompt as plain text (what lm-eval shows, and what a model without this protocol is given)."""
    head = f"{sample['instruction']}\n\n" if sample["instruction"] else ""
    cue = sample.get("answer_prefix") or "Answer:"
    return f"{head}{sample['document']}\n\n{sample['question']}\n{cue}"

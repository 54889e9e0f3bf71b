"""lm-eval glue for kvc_multi_question: the samples and scores come from hf_kvcompress.eval (see lm_eval_tasks.py)."""

from hf_kvcompress.eval.lm_eval_tasks import dataset, doc_to_target, doc_to_text, process_results  # noqa: F401


def load(**metadata):
    """Samples of `multi_question`: RUN_DIR/data/multi_question.jsonl with metadata data_dir, else built with the
    model's tokenizer."""
    return dataset("multi_question", **metadata)

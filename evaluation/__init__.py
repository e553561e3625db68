"""Evaluation of Synthformer models with EleutherAI's lm-evaluation-harness.

`evaluation.lm_eval_adapter` registers the lm-eval model `synthformer` when it is imported (lm-eval 0.4.13 finds models
only in its in-process registry: it reads no entry points), so import it before `lm_eval.simple_evaluate`, or run
`tools/run_lm_eval.py`, lm-eval's own CLI with the adapter imported and the repository's `tasks/` included:

    python tools/run_lm_eval.py --model synthformer --model_args path=runs/demo-release --tasks austen_cloze,austen_mc4

This package stays light on import; only the adapter module pulls in lm_eval (and datasets).
"""

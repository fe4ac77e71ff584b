"""The path of earlier releases of `nag_lightning.analysis.evaluation.lm_eval_model`, kept so that
`python -m nag_lightning.analysis.lm_eval_model ...` (lm-eval's own command with the model
registered) runs as before."""

from nag_lightning.analysis.evaluation.lm_eval_model import NagLM  # noqa: F401 - registers the model

if __name__ == "__main__":
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()

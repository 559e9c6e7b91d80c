"""`python -m experiments.plot --workdir=runs/demo`: PNG curves of a run directory."""

from absl import app, flags

from flashrl_jax.controller import plot_run

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory with metrics.jsonl.", required=True)


def main(argv):
  del argv
  for path in plot_run(_WORKDIR.value):
    print(path)


if __name__ == "__main__":
  app.run(main)

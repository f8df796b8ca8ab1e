"""The experiments a diagnosis suggests: hypothesis replays, objectives under the run's convention, and the
experiments that cannot move the step."""

# The README and docs/retrieval.md frontier: the simulated levers (docs/results/levers/levers.jsonl, appended to by
# `python -m experiments.retrieval.levers --out docs/results/levers`) and the greedy needle runs of the presets.
cd "$(dirname "$0")/../.."
R=docs/results
python -m experiments.retrieval.frontier docs/results/levers/levers.jsonl --out docs/results/levers --needles \
  "hadamard=2.5=$R/needles-cpu-hadamard/needles.md=oscar" \
  "quarot=2.5=$R/needles-cpu-hadamard/needles.md=quarot" \
  "oscar, calibrated=2.5=$R/needles-cpu-calibrated/needles.md=oscar" \
  "oscar-mixed, calibrated, keys smoothed=2.475=$R/needles-cpu-mixed-smoothed-calibrated/needles.md=oscar-mixed" \
  "oscar-mixed, calibrated=2.475=$R/needles-cpu-mixed-calibrated/needles.md=oscar-mixed" \
  "oscar-mixed, Hadamard, keys smoothed=2.475=$R/needles-cpu-mixed-hadamard-smoothed/needles.md=oscar-mixed" \
  "oscar-mixed, Hadamard=2.475=$R/needles-cpu-mixed-hadamard/needles.md=oscar-mixed" \
  "oscar-next, calibrated, keys smoothed=2.475=$R/needles-cpu-next-f16-4bit-smoothed-calibrated/needles.md=oscar-next" \
  "oscar-next, calibrated=2.475=$R/needles-cpu-next-f16-4bit-calibrated/needles.md=oscar-next" \
  "oscar-next, Hadamard, keys smoothed=2.475=$R/needles-cpu-next-f16-4bit-smoothed-hadamard/needles.md=oscar-next" \
  "oscar-next, Hadamard=2.475=$R/needles-cpu-next-f16-4bit-hadamard/needles.md=oscar-next" \
  "oscar-hifi, calibrated=2.9=$R/needles-cpu-hifi-calibrated/needles.md=oscar-hifi" \
  "oscar-hifi, Hadamard=2.9=$R/needles-cpu-hifi-hadamard-generated-ranking/needles.md=oscar-hifi" \
  "Hadamard, layers 6 7 14 17 18 23=2.9=$R/needles-cpu-hifi-hadamard/needles.md=oscar-hifi" \
  "Hadamard, ten layers=3.17=$R/needles-cpu-hifi10-hadamard/needles.md=oscar-hifi" \
  "hadamard4=4.5=$R/needles-cpu-4bit-noclip/needles.md=oscar4" \
  "hadamard4, clipped=4.5=$R/needles-cpu-hadamard/needles.md=oscar4" \
  "oscar4, calibrated=4.5=$R/needles-cpu-hifi-calibrated/needles.md=oscar4" $EXTRA

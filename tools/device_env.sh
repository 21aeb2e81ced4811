# Source on the lent GPU machine from the project root (after ../shared/device/pack.sh --anchors and
# tools/pack_extra.sh here): installs CuTe-DSL, flash-attn-4 and fa4gen's own pure-Python needs that
# the machine's image lacks (pydantic), once per machine.
source .device/setup.sh
if [ ! -f /tmp/site-extra/.done ] && [ -d .device/extra ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-extra .device/extra/*.whl \
    && touch /tmp/site-extra/.done
fi
export PYTHONPATH=/tmp/site-extra:$PYTHONPATH

# Source on the lent GPU machine from the project root (after ../shared/device/pack.sh --anchors and
# tools/pack_extra.sh here): installs CuTe-DSL, flash-attn-4 and fa4gen's own pure-Python needs that
# the machine's image lacks (pydantic), once per machine.
source .device/setup.sh
if [ ! -f /tmp/site-extra/.done ] && [ -d .device/extra ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-extra .device/extra/*.whl \
    && touch /tmp/site-extra/.done
fi
export PYTHONPATH=/tmp/site-extra:$PYTHONPATH
# fa4gen compiles with CuTe-DSL's TVM FFI (apache-tvm-ffi), which only .device/anchors carries: session 66 lost a
# device call to leaving that folder out for the carry limit (every kernel then failed with CONFIG_MISSING_TVM_FFI)
if ! python3 -c "import tvm_ffi" 2>/dev/null; then
  echo "device_env: TVM FFI is not importable: carry .device with its anchors folder (../shared/device/pack.sh --anchors);" \
       "it holds the apache-tvm-ffi wheel every fa4gen compile needs" >&2
fi

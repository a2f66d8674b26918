"""How a step's products and attention run on a CPU: `layers` chooses each linear's and attention's kernel,
`native` builds and loads dflash's own C++ kernels (`native.cpp`), `quantized` holds the int4/int8 linears."""

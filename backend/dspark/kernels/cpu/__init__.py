"""CPU kernels: C++ built once per machine by torch's extension builder (`linear`: fp32 products)."""

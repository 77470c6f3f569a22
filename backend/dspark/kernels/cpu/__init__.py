"""CPU kernels: C++ built once per machine by torch's extension builder (`linear`: few-row products)."""

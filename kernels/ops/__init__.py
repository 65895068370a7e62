"""One module per ggml op family; importing a module registers its kernels (kernels.registry).

Op modules stand on the kernels core and on kernels.formats, never on each other.
"""

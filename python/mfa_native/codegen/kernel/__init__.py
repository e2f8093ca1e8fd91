"""The ground floor of codegen: MSL text helpers, sizes and layouts, launch plans, 8x8 tiles,
tile tables, assembling a kernel, and pass descriptions. It imports no other wing."""

"""quantkit.quant"""

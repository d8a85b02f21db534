"""pivotrl.engines"""

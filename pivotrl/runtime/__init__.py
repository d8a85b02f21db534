"""pivotrl.runtime"""

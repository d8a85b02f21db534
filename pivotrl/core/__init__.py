"""pivotrl.core"""

"""pivotrl.gps"""

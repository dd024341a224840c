"""meshtron.data"""

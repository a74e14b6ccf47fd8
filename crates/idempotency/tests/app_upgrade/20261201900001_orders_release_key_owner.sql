-- Before the crate's 20261202000001, which turns the key's owner into text: the reference by an
-- integer owner goes, or that migration refuses.
ALTER TABLE orders DROP CONSTRAINT orders_user_id_key_id_fkey;

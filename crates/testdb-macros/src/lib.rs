//! `#[testdb::test]`: turns `async fn name(pool: PgPool) { … }` (or
//! `async fn name(_: PgPoolOptions, options: PgConnectOptions)`) into a `#[test]` that runs it
//! on a fresh database of its own, made by `testdb::run` (crates/testdb, which documents it).
//!
//! Written with `proc_macro` alone: the attribute only splits the function into its
//! attributes, its name, its parameters and the rest, and wraps it.

use proc_macro::{Delimiter, Group, Ident, TokenStream, TokenTree};

/// A test over a fresh database; `#[testdb::test(template = path::to::migrated)]` clones it
/// from a template that `migrated` (an `async fn(PgPool)`) made once per test binary.
#[proc_macro_attribute]
pub fn test(args: TokenStream, item: TokenStream) -> TokenStream {
    match expand(args, item) {
        Ok(tokens) => tokens,
        Err(message) => format!("compile_error!({message:?});").parse().unwrap(),
    }
}

fn expand(args: TokenStream, item: TokenStream) -> Result<TokenStream, String> {
    let template = template(args)?;
    let tokens: Vec<TokenTree> = item.into_iter().collect();
    // Leading attributes (doc comments, `#[ignore]`) go on the generated `#[test]`.
    let mut start = 0;
    while matches!(&tokens.get(start), Some(TokenTree::Punct(p)) if p.as_char() == '#') {
        start += 2;
    }
    let (attributes, function) = tokens.split_at(start.min(tokens.len()));
    let at_fn = function
        .iter()
        .position(|t| matches!(t, TokenTree::Ident(i) if i.to_string() == "fn"))
        .ok_or("#[testdb::test] goes on an `async fn`")?;
    if !function[..at_fn]
        .iter()
        .any(|t| matches!(t, TokenTree::Ident(i) if i.to_string() == "async"))
    {
        return Err("#[testdb::test] goes on an `async fn`".into());
    }
    let name = match function.get(at_fn + 1) {
        Some(TokenTree::Ident(name)) => name.clone(),
        _ => return Err("#[testdb::test]: a function name after `fn`".into()),
    };
    let arity = match function.get(at_fn + 2) {
        Some(TokenTree::Group(g)) if g.delimiter() == Delimiter::Parenthesis => {
            parameters(g.stream())
        }
        _ => return Err("#[testdb::test]: generic test functions are not supported".into()),
    };
    let pointer = match arity {
        1 => "fn(_) -> _",
        2 => "fn(_, _) -> _",
        _ => {
            return Err("#[testdb::test] takes `(pool: PgPool)` or \
                        `(_: PgPoolOptions, options: PgConnectOptions)`"
                .into())
        }
    };
    let call: TokenStream = format!(
        "let test: {pointer} = {name};
         ::testdb::run(::core::concat!(::core::module_path!(), \"::\", ::core::stringify!({name})), {template}, test)"
    )
    .parse()
    .map_err(|e| format!("#[testdb::test]: {e}"))?;

    let mut body: TokenStream = function.iter().cloned().collect();
    body.extend(call);
    let mut out: TokenStream = attributes.iter().cloned().collect();
    out.extend(
        "#[::core::prelude::v1::test] fn"
            .parse::<TokenStream>()
            .unwrap(),
    );
    out.extend([
        TokenTree::Ident(Ident::new(&name.to_string(), name.span())),
        TokenTree::Group(Group::new(Delimiter::Parenthesis, TokenStream::new())),
        TokenTree::Group(Group::new(Delimiter::Brace, body)),
    ]);
    Ok(out)
}

/// `None`, or the expression of a `testdb::Template` named by `template = path`.
fn template(args: TokenStream) -> Result<String, String> {
    let args: Vec<TokenTree> = args.into_iter().collect();
    if args.is_empty() {
        return Ok("::core::option::Option::None".into());
    }
    match (&args.first(), &args.get(1)) {
        (Some(TokenTree::Ident(key)), Some(TokenTree::Punct(eq)))
            if key.to_string() == "template" && eq.as_char() == '=' && args.len() > 2 =>
        {
            let path: TokenStream = args[2..].iter().cloned().collect();
            Ok(format!(
                "::core::option::Option::Some(::testdb::Template {{
                     name: ::core::any::type_name_of_val(&{path}),
                     migrate: |pool| ::std::boxed::Box::pin({path}(pool)),
                 }})"
            ))
        }
        _ => Err("#[testdb::test] takes nothing or `template = path::to::async_fn`".into()),
    }
}

/// How many parameters a parenthesised list holds (commas inside `<…>` do not count).
fn parameters(list: TokenStream) -> usize {
    let (mut count, mut depth, mut pending) = (0, 0i32, false);
    for token in list {
        match &token {
            TokenTree::Punct(p) if p.as_char() == '<' => depth += 1,
            TokenTree::Punct(p) if p.as_char() == '>' => depth -= 1,
            TokenTree::Punct(p) if p.as_char() == ',' && depth == 0 => {
                count += usize::from(pending);
                pending = false;
                continue;
            }
            _ => {}
        }
        pending = true;
    }
    count + usize::from(pending)
}

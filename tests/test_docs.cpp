// test_docs.cpp: the figures README.md quotes, each against the file it comes from (Catch2 v2).
//
//   [readme]  every measured figure in README.md is what its data file says, rounded as quoted
//
// How README.md names its sources. Above each paragraph or table that quotes figures stands an
// HTML comment (GitHub does not show it) saying where each figure comes from:
//
//   <!-- figures:
//   "the forward ran at # TFLOP/s": data/demo-default.log "flash forward ... # TFLOP/s"
//   "bf16 runs at #–#× fp16": data/bench-e22bf88-bf16.csv seq<=8192 flash_fwd_tflops
//       over data/bench-e22bf88-fp16.csv flash_fwd_tflops on dim,seq,causal
//   -->
//
// The comment's first line starts with "<!-- figures" (the rest of it is free text), its last
// ends with "-->". Each quoted text is a piece of the paragraph below it (to its first blank line),
// with # where a figure stands and ... for any text; #–# is a range. After the colon comes a
// lookup (it may go on over further lines): a file, then what to read in it.
//   .csv (lines starting with # are comments; the first other line names the columns):
//     key=value  key=a|b  key<=value  key>=value    the rows to read
//     column  column/1024  |column-column|           a row's value (1024: MiB to GiB)
//     max  min                                      the largest or smallest row, not the first
//   .log or .txt: one "text with # where the number is"; every line that holds it is a row, and
//     {name} in it reads a field of the row (as a .csv's column) and ... skips any text
//   .cu or .cpp: `kernel NAME`, the kernel's lines of code as NOTES.md section 6 counts them
//     (from the __global__ line to the closing brace, blank and comment-only lines left out),
//     or `lines`, all the file's lines
//   ... over LOOKUP on key,key: the first lookup's value divided by the second's, row by row; a
//     row's divisor is the second lookup's first row with the same values of the keys
// A single figure is the value of the first row the lookup selects (with key=a|b, of the first
// row for each of a and b: both must agree); a range is the smallest and the largest value over
// every row it selects. A figure must read as its value printed with the figure's decimals.
//
// A table's comment names its columns and what each number in a cell is, then a lookup per row,
// by the row's first cell; each number is read with the row's lookup, its column's terms and its
// place in the cell's terms added. A cells: line under a row's lookup is that row's own:
//   columns: dim=64 seq=2048, dim=128 seq=2048
//   cells: causal=0, causal=1                        "26.1 (24.0)": no mask, then causal
//   "fp32 flash forward": bench_h100.csv dtype=fp32 flash_fwd_tflops
//   "fp16 standard attention": bench_h100.csv dtype=fp16 causal=0
//     cells: std_fwd_tflops, std_bwd_tflops          "44 / 111": forward, then backward
//
// So a re-measurement is one edit of the data file and one of the README; this test names every
// figure that no longer agrees. As a net for new figures, any number in README.md followed by a
// unit of speed, time, memory, ratio or size (TFLOP/s, ms, s, MiB, GiB, ×, %, lines) must be one
// that a figures comment checks.

#include "test_util.h"

#include <map>
#include <memory>
#include <regex>
#include <set>
#include <stdexcept>

namespace {

// ---------------------------------------------------------------------------------------------
// Lookups: which rows of which file, and what value each row gives

struct Filter {
    std::string key, op;              // op: "=", "<=" or ">="
    std::vector<std::string> values;  // key=a|b: either
};

struct Lookup {
    std::string file;
    std::vector<Filter> filters;
    std::string value;             // a .csv's column expression, a text file's pattern, or a
                                   // source file's `kernel NAME` or `lines`
    std::string pick;              // "" (the first row), "max" or "min"
    std::shared_ptr<Lookup> over;  // the divisor, or none
    std::vector<std::string> on;   // the keys that pair a row with its divisor's row
};

struct Row {
    std::map<std::string, std::string> fields;
    double value = 0;
    std::string where;  // "file:line"
};

bool ends_with(const std::string& s, const std::string& end) {
    return s.size() >= end.size() && s.compare(s.size() - end.size(), end.size(), end) == 0;
}

std::vector<std::string> split(const std::string& s, char by) {
    std::vector<std::string> parts;
    std::stringstream in(s);
    for (std::string part; std::getline(in, part, by);) parts.push_back(part);
    return parts;
}

std::string trimmed(const std::string& s) {
    const size_t b = s.find_first_not_of(' '), e = s.find_last_not_of(' ');
    return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

// Words separated by spaces, a "quoted text" being one word (quotes kept).
std::vector<std::string> words(const std::string& s) {
    std::vector<std::string> out;
    for (size_t at = s.find_first_not_of(' '); at != std::string::npos;
         at = s.find_first_not_of(' ', at)) {
        if (s[at] == '"') {
            const size_t end = s.find('"', at + 1);
            if (end == std::string::npos) throw std::runtime_error("unclosed quote in: " + s);
            out.push_back(s.substr(at, end - at + 1));
            at = end + 1;
        } else {
            const size_t end = std::min(s.find(' ', at), s.size());
            out.push_back(s.substr(at, end - at));
            at = end;
        }
    }
    return out;
}

// One word of a lookup, after its file: a filter, a pick, or the value.
void add_term(Lookup& l, const std::string& term) {
    if (term.size() >= 2 && term.front() == '"') {  // a text file's pattern
        l.value = term.substr(1, term.size() - 2);
        return;
    }
    if (term == "max" || term == "min") {
        l.pick = term;
        return;
    }
    for (const char* op : {"<=", ">=", "="}) {
        const size_t at = term.find(op);
        if (at == std::string::npos || at == 0) continue;
        const std::string alternatives = term.substr(at + std::strlen(op));
        l.filters.push_back({term.substr(0, at), op, split(alternatives, '|')});
        return;
    }
    if (!l.value.empty()) throw std::runtime_error("two values: " + l.value + " and " + term);
    l.value = term;
}

bool is_source(const std::string& file) {
    return ends_with(file, ".cu") || ends_with(file, ".cpp");
}

Lookup parse_lookup(const std::string& text) {
    const std::vector<std::string> w = words(text);
    if (w.empty()) throw std::runtime_error("a figure without a lookup");
    Lookup l;
    l.file = w[0];
    Lookup* into = &l;
    for (size_t k = 1; k < w.size(); ++k) {
        if (w[k] == "over" && k + 1 < w.size() && !l.over) {
            l.over = std::make_shared<Lookup>();
            l.over->file = w[++k];
            into = l.over.get();
        } else if (w[k] == "on" && k + 1 < w.size() && l.over) {
            l.on = split(w[++k], ',');
        } else if (is_source(l.file)) {
            into->value += (into->value.empty() ? "" : " ") + w[k];  // kernel NAME
        } else {
            add_term(*into, w[k]);
        }
    }
    if (l.over && l.on.empty()) throw std::runtime_error("`over` needs `on KEYS`: " + text);
    return l;
}

// A pattern as a regular expression: # is a number (a group), {name} a field (a group), ... any
// text, a run of spaces any whitespace (so a pattern may match across a README line break).
std::regex pattern_regex(const std::string& pattern, std::vector<std::string>* groups) {
    std::string re;
    for (size_t k = 0; k < pattern.size(); ++k) {
        const char c = pattern[k];
        if (c == '#') {
            re += "(-?[0-9]+(?:\\.[0-9]+)?)";
            groups->push_back("#");
        } else if (c == '{' && pattern.find('}', k) != std::string::npos) {
            const size_t end = pattern.find('}', k);
            groups->push_back(pattern.substr(k + 1, end - k - 1));
            re += "([^\\s,;:]+)";
            k = end;
        } else if (pattern.compare(k, 3, "...") == 0) {
            re += ".*?";
            k += 2;
        } else if (c == ' ') {
            re += "\\s+";
            while (k + 1 < pattern.size() && pattern[k + 1] == ' ') ++k;
        } else {
            if (std::strchr(".^$|()[]{}*+?\\", c)) re += '\\';
            re += c;
        }
    }
    return std::regex(re);
}

double to_number(const std::string& s, const std::string& where) {
    try {
        size_t used = 0;
        const double v = std::stod(s, &used);
        if (used == s.size()) return v;
    } catch (const std::exception&) {
    }
    throw std::runtime_error(where + ": '" + s + "' is not a number");
}

// A .csv row's value: column, column/NUMBER, or |column-column|.
double csv_value(const std::map<std::string, std::string>& row, const std::string& expr,
                 const std::string& where) {
    const auto column = [&](const std::string& name) {
        const auto it = row.find(name);
        if (it == row.end()) throw std::runtime_error(where + " has no column " + name);
        return to_number(it->second, where);
    };
    if (expr.size() > 2 && expr.front() == '|' && expr.back() == '|') {
        const std::vector<std::string> ab = split(expr.substr(1, expr.size() - 2), '-');
        if (ab.size() != 2) throw std::runtime_error("not |a-b|: " + expr);
        return std::fabs(column(ab[0]) - column(ab[1]));
    }
    const size_t slash = expr.find('/');
    if (slash == std::string::npos) return column(expr);
    return column(expr.substr(0, slash)) / to_number(expr.substr(slash + 1), expr);
}

// The lines of code of kernel `name` in a source file, counted as NOTES.md section 6 does.
int kernel_lines(const std::vector<std::string>& src, const std::string& name) {
    for (size_t k = 0; k < src.size(); ++k) {
        if (src[k].rfind(name + "(", 0) != 0) continue;  // the definition's name line
        size_t first = k;
        while (first > 0 && src[first].find("__global__") == std::string::npos) --first;
        int depth = 0, lines = 0;
        bool opened = false;
        for (size_t n = first; n < src.size(); ++n) {
            const std::string code = src[n].substr(0, src[n].find("//"));
            if (!code.empty()) ++lines;
            for (char c : code) depth += c == '{' ? 1 : c == '}' ? -1 : 0;
            opened = opened || code.find('{') != std::string::npos;
            if (opened && depth == 0) return lines;
        }
    }
    throw std::runtime_error("no kernel " + name + " defined at the start of a line");
}

// Every row of l's file (before any filter), with l's value.
std::vector<Row> file_rows(const Lookup& l) {
    const std::vector<std::string> lines = source_lines(l.file);
    std::vector<Row> rows;
    if (is_source(l.file)) {
        Row r;
        r.where = l.file;
        if (l.value == "lines") r.value = double(lines.size());
        else if (l.value.rfind("kernel ", 0) == 0) r.value = kernel_lines(lines, l.value.substr(7));
        else throw std::runtime_error(l.file + ": read `kernel NAME` or `lines`, not " + l.value);
        rows.push_back(r);
    } else if (ends_with(l.file, ".csv")) {
        std::vector<std::string> header;
        for (size_t n = 0; n < lines.size(); ++n) {
            if (lines[n].empty() || lines[n][0] == '#') continue;
            const std::vector<std::string> cells = split(lines[n], ',');
            if (header.empty()) {
                header = cells;
                continue;
            }
            Row r;
            r.where = l.file + ":" + std::to_string(n + 1);
            for (size_t c = 0; c < cells.size() && c < header.size(); ++c)
                r.fields[header[c]] = cells[c];
            r.value = csv_value(r.fields, l.value, r.where);
            rows.push_back(r);
        }
    } else {
        std::vector<std::string> groups;
        const std::regex re = pattern_regex(l.value, &groups);
        if (std::count(groups.begin(), groups.end(), "#") != 1)
            throw std::runtime_error(l.file + ": its pattern needs one #: \"" + l.value + "\"");
        for (size_t n = 0; n < lines.size(); ++n) {
            std::smatch m;
            if (!std::regex_search(lines[n], m, re)) continue;
            Row r;
            r.where = l.file + ":" + std::to_string(n + 1);
            for (size_t g = 0; g < groups.size(); ++g) {
                if (groups[g] == "#") r.value = to_number(m[g + 1], r.where);
                else r.fields[groups[g]] = m[g + 1];
            }
            rows.push_back(r);
        }
    }
    return rows;
}

bool passes(const Row& r, const Filter& f) {
    const auto it = r.fields.find(f.key);
    if (it == r.fields.end()) throw std::runtime_error(r.where + " has no field " + f.key);
    for (const std::string& v : f.values) {
        if (f.op == "=" && it->second == v) return true;
        if (f.op != "=") {
            const double x = to_number(it->second, r.where), bound = to_number(v, f.key);
            if (f.op == "<=" ? x <= bound : x >= bound) return true;
        }
    }
    return false;
}

// The rows l selects, in file order, each with its value (divided by its divisor's, with over).
std::vector<Row> selected_rows(const Lookup& l) {
    std::vector<Row> rows;
    for (const Row& r : file_rows(l)) {
        if (std::all_of(l.filters.begin(), l.filters.end(),
                        [&](const Filter& f) { return passes(r, f); }))
            rows.push_back(r);
    }
    if (!l.over) return rows;
    const std::vector<Row> divisors = selected_rows(*l.over);
    for (Row& r : rows) {
        const auto pair = std::find_if(divisors.begin(), divisors.end(), [&](const Row& d) {
            return std::all_of(l.on.begin(), l.on.end(), [&](const std::string& key) {
                return d.fields.count(key) && r.fields.count(key) &&
                       d.fields.at(key) == r.fields.at(key);
            });
        });
        if (pair == divisors.end()) {
            std::string keys;
            for (const std::string& key : l.on)
                keys += " " + key + "=" + (r.fields.count(key) ? r.fields.at(key) : "?");
            throw std::runtime_error(l.over->file + " has no row with" + keys + " for " + r.where);
        }
        r.value /= pair->value;
        r.where += " / " + pair->where;
    }
    return rows;
}

// One lookup per alternative of its key=a|b filters (a single figure must hold for each).
std::vector<Lookup> alternatives(const Lookup& l) {
    for (size_t f = 0; f < l.filters.size(); ++f) {
        if (l.filters[f].op != "=" || l.filters[f].values.size() < 2) continue;
        std::vector<Lookup> out;
        for (const std::string& v : l.filters[f].values) {
            Lookup one = l;
            one.filters[f].values = {v};
            for (const Lookup& each : alternatives(one)) out.push_back(each);
        }
        return out;
    }
    return {l};
}

std::string printed(double v, int decimals) {
    std::ostringstream out;
    out << std::fixed << std::setprecision(decimals) << v;
    return out.str();
}

int decimals_of(const std::string& figure) {
    const size_t dot = figure.find('.');
    return dot == std::string::npos ? 0 : int(figure.size() - dot - 1);
}

std::string value_at(const Row& r) {
    std::ostringstream out;
    out << std::setprecision(6) << r.value << " (" << r.where << ")";
    return out.str();
}

bool by_value(const Row& a, const Row& b) { return a.value < b.value; }

// What is wrong with a figure (one number, or a range of two) read with lookup l; "" if nothing.
std::string figure_problem(const std::vector<std::string>& figure, const Lookup& l) {
    if (figure.size() == 2) {
        const std::vector<Row> rows = selected_rows(l);
        if (rows.empty()) return "no row of " + l.file + " matches";
        const Row& lo = *std::min_element(rows.begin(), rows.end(), by_value);
        const Row& hi = *std::max_element(rows.begin(), rows.end(), by_value);
        const std::string want = printed(lo.value, decimals_of(figure[0])) + "–" +
                                 printed(hi.value, decimals_of(figure[1]));
        if (want == figure[0] + "–" + figure[1]) return "";
        return "should be " + want + ": " + std::to_string(rows.size()) + " rows of " + l.file +
               " run from " + value_at(lo) + " to " + value_at(hi);
    }
    for (const Lookup& one : alternatives(l)) {
        const std::vector<Row> rows = selected_rows(one);
        if (rows.empty()) return "no row of " + l.file + " matches";
        const Row& r = one.pick == "max"   ? *std::max_element(rows.begin(), rows.end(), by_value)
                       : one.pick == "min" ? *std::min_element(rows.begin(), rows.end(), by_value)
                                           : rows.front();
        const std::string want = printed(r.value, decimals_of(figure[0]));
        if (want != figure[0]) return "should be " + want + ": " + value_at(r);
    }
    return "";
}

// ---------------------------------------------------------------------------------------------
// The document: its figures comments, the paragraphs and tables below them

const std::regex kNumber("[0-9]+(?:\\.[0-9]+)?");

struct Report {
    std::vector<std::string> problems;
    int figures = 0;                            // figures checked
    std::set<std::pair<size_t, size_t>> seen;   // (line, column) where each starts
};

// One figure: checks it, counts it, and remembers where it stands.
void check_figure(Report& rep, const std::string& doc, size_t line, size_t col,
                  const std::vector<std::string>& figure, const Lookup& l,
                  const std::string& what) {
    ++rep.figures;
    rep.seen.insert({line, col});
    std::string problem;
    try {
        problem = figure_problem(figure, l);
    } catch (const std::exception& e) {
        problem = e.what();
    }
    if (problem.empty()) return;
    const std::string shown = figure.size() == 2 ? figure[0] + "–" + figure[1] : figure[0];
    rep.problems.push_back(doc + ":" + std::to_string(line + 1) + ": " + shown + " (" + what +
                           ") from " + l.file + " " + problem);
}

struct Spec {
    std::string text;    // a pattern in the paragraph, or a table row's first cell
    std::string lookup;  // what follows the colon
    size_t line;         // of the comment
};

// A table: every row needs a spec; every number of a cell is one figure.
void check_table(Report& rep, const std::string& doc, const std::vector<std::string>& lines,
                 size_t first, size_t end, const std::vector<Spec>& specs,
                 const std::vector<std::string>& columns, const std::string& cells) {
    std::set<std::string> used;
    for (size_t n = first + 2; n < end; ++n) {  // past the header and the |---| line
        const std::vector<std::string> cell = split(lines[n], '|');
        const std::string label = cell.size() > 1 ? trimmed(cell[1]) : "";
        const auto spec = std::find_if(specs.begin(), specs.end(),
                                       [&](const Spec& s) { return s.text == label; });
        if (spec == specs.end()) {
            rep.problems.push_back(doc + ":" + std::to_string(n + 1) + ": the row \"" + label +
                                   "\" has no lookup in the figures comment above the table");
            continue;
        }
        used.insert(label);
        std::string base = spec->lookup, row_cells = cells;
        if (base.find("; cells:") != std::string::npos) {
            row_cells = base.substr(base.find("; cells:") + 8);
            base = base.substr(0, base.find("; cells:"));
        }
        const std::vector<std::string> slots = split(row_cells, ',');
        if (cell.size() - 2 != columns.size())
            rep.problems.push_back(doc + ":" + std::to_string(n + 1) + ": " +
                                   std::to_string(cell.size() - 2) + " cells, but " +
                                   std::to_string(columns.size()) + " columns named");
        size_t col = lines[n].find('|', 1);  // where the cell after the label starts
        for (size_t c = 2; c < cell.size() && c - 2 < columns.size(); ++c) {
            std::vector<std::pair<std::string, size_t>> numbers;
            for (auto it = std::sregex_iterator(cell[c].begin(), cell[c].end(), kNumber);
                 it != std::sregex_iterator(); ++it)
                numbers.push_back({it->str(), col + 1 + size_t(it->position())});
            if (numbers.size() != slots.size())
                rep.problems.push_back(doc + ":" + std::to_string(n + 1) + ": \"" + cell[c] +
                                       "\" holds " + std::to_string(numbers.size()) +
                                       " numbers; the comment says " +
                                       std::to_string(slots.size()));
            for (size_t k = 0; k < numbers.size() && k < slots.size(); ++k) {
                try {
                    Lookup l = parse_lookup(base);
                    for (const std::string& t : words(columns[c - 2] + " " + slots[k]))
                        add_term(l, t);
                    check_figure(rep, doc, n, numbers[k].second, {numbers[k].first}, l,
                                 label + ", column " + std::to_string(c - 1));
                } catch (const std::exception& e) {
                    rep.problems.push_back(doc + ":" + std::to_string(spec->line + 1) + ": " +
                                           e.what());
                }
            }
            col += cell[c].size() + 1;
        }
    }
    for (const Spec& s : specs)
        if (!used.count(s.text))
            rep.problems.push_back(doc + ":" + std::to_string(s.line + 1) + ": no table row \"" +
                                   s.text + "\" below");
}

// A paragraph: each spec's pattern must be in it, its # a figure (#–#: a range).
void check_paragraph(Report& rep, const std::string& doc, const std::vector<std::string>& lines,
                     size_t first, size_t end, const std::vector<Spec>& specs) {
    std::string text;
    for (size_t n = first; n < end; ++n) text += lines[n] + (n + 1 < end ? "\n" : "");
    for (const Spec& s : specs) {
        const std::string at = doc + ":" + std::to_string(s.line + 1) + ": ";
        try {
            std::vector<std::string> groups;
            std::smatch m;
            if (!std::regex_search(text, m, pattern_regex(s.text, &groups))) {
                rep.problems.push_back(at + "\"" + s.text + "\" is not in the paragraph below");
                continue;
            }
            if (groups.empty() || groups.size() > 2 ||
                std::count(groups.begin(), groups.end(), "#") != long(groups.size()))
                throw std::runtime_error("\"" + s.text + "\": a figure is # or #–#");
            const size_t pos = size_t(m.position(1));
            const size_t line = first + size_t(std::count(text.begin(), text.begin() + pos, '\n'));
            const size_t col = pos - (text.rfind('\n', pos) == std::string::npos
                                          ? 0 : text.rfind('\n', pos) + 1);
            std::vector<std::string> figure;
            for (size_t g = 1; g <= groups.size(); ++g) figure.push_back(m[g]);
            check_figure(rep, doc, line, col, figure, parse_lookup(s.lookup), s.text);
        } catch (const std::exception& e) {
            rep.problems.push_back(at + e.what());
        }
    }
}

// Checks every figures comment of a document (its lines, trimmed, as source_lines gives them),
// then looks for figures with a unit that no comment checks.
Report check_document(const std::vector<std::string>& lines, const std::string& doc) {
    Report rep;
    for (size_t n = 0; n < lines.size(); ++n) {
        if (lines[n].rfind("<!-- figures", 0) != 0 || ends_with(lines[n], "-->")) continue;
        std::vector<Spec> specs;
        std::vector<std::string> columns;
        std::string cells;
        size_t k = n + 1;
        for (; k < lines.size(); ++k) {
            std::string l = lines[k];
            const bool last = ends_with(l, "-->");
            if (last) l = trimmed(l.substr(0, l.size() - 3));
            if (l.rfind("columns:", 0) == 0) columns = split(l.substr(8), ',');
            else if (l.rfind("cells:", 0) == 0 && !specs.empty()) specs.back().lookup += "; " + l;
            else if (l.rfind("cells:", 0) == 0) cells = l.substr(6);
            else if (!l.empty() && l[0] == '"' && l.find("\":", 1) != std::string::npos)
                specs.push_back({l.substr(1, l.find("\":") - 1), l.substr(l.find("\":") + 2), k});
            else if (!l.empty() && !specs.empty())
                specs.back().lookup += " " + l;  // a lookup goes on
            if (last) break;
        }
        size_t end = k + 1;
        while (end < lines.size() && !lines[end].empty()) ++end;
        if (k + 1 < lines.size() && lines[k + 1].rfind("|", 0) == 0)
            check_table(rep, doc, lines, k + 1, end, specs, columns, cells);
        else
            check_paragraph(rep, doc, lines, k + 1, end, specs);
        n = k;
    }
    // The net: a number with a unit, outside code blocks and comments, must have been checked.
    const std::regex with_unit(
        "([0-9]+(?:\\.[0-9]+)?)(?:–[0-9]+(?:\\.[0-9]+)?)?\\*?"
        "(?: ?(?:TFLOP/s|ms|s|MiB|GiB|%|lines)(?![A-Za-z])|×)");  // "16384 × 32" is no ratio
    bool code = false, comment = false;
    for (size_t n = 0; n < lines.size(); ++n) {
        if (lines[n].rfind("```", 0) == 0) code = !code;
        if (lines[n].rfind("<!--", 0) == 0) comment = true;
        if (!code && !comment) {
            for (auto it = std::sregex_iterator(lines[n].begin(), lines[n].end(), with_unit);
                 it != std::sregex_iterator(); ++it) {
                if (rep.seen.count({n, size_t(it->position(1))})) continue;
                rep.problems.push_back(doc + ":" + std::to_string(n + 1) + ": \"" + it->str() +
                                       "\" has no figures comment naming where it comes from");
            }
        }
        if (comment && ends_with(lines[n], "-->")) comment = false;
    }
    return rep;
}

}  // namespace

TEST_CASE("Every figure README.md quotes is what its data file says", "[cpu][readme]") {
    const Report rep = check_document(source_lines("README.md"), "README.md");
    for (const std::string& problem : rep.problems) FAIL_CHECK(problem);
    INFO("README.md's figures comments should check its tables and its measured prose");
    CHECK(rep.figures >= 100);
}

// The check itself must be able to fail: a figure one digit off, a source-less figure, a missing
// pattern. bench_h100.csv's fp32 forward takes no extra memory at any shape, so this stays true
// when the data is re-measured.
TEST_CASE("A figure that disagrees with its data file fails the README check", "[cpu][readme]") {
    const auto doc = [](const std::string& figure) {
        return std::vector<std::string>{
            "<!-- figures:",
            "\"the forward takes # MiB\": bench_h100.csv dtype=fp32 dim=64 seq=2048 causal=1",
            "flash_fwd_extra_mib",
            "-->",
            "At N = 2048 the forward takes " + figure + " MiB beyond its inputs.",
            "",
            "Elsewhere it runs at 99 TFLOP/s."};
    };
    const Report good = check_document(doc("0"), "X.md");
    REQUIRE(good.figures == 1);
    REQUIRE(good.problems.size() == 1);  // the net: the unchecked 99 TFLOP/s
    CHECK_THAT(good.problems[0], Catch::Contains("X.md:7") && Catch::Contains("99 TFLOP/s"));

    const Report bad = check_document(doc("1"), "X.md");
    REQUIRE(bad.problems.size() == 2);
    CHECK_THAT(bad.problems[0], Catch::Contains("X.md:5: 1 (the forward takes # MiB)") &&
                                    Catch::Contains("bench_h100.csv") &&
                                    Catch::Contains("should be 0"));

    std::vector<std::string> gone = doc("0");
    gone[4] = "The forward's memory is not quoted here.";
    const Report missing = check_document(gone, "X.md");
    REQUIRE(missing.problems.size() == 2);
    CHECK_THAT(missing.problems[0], Catch::Contains("X.md:2") && Catch::Contains("not in the"));
}
